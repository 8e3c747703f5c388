"""Temperature and truncation of the support (top-k, top-p, min-p), per-row parameters, vectorised."""

from __future__ import annotations

import torch

from toolkit import devices
from toolkit.devices import tensor_on
from toolkit.native.sampling_ops import truncate_cpu
from toolkit.sampling.processors.base import NEG_INF, BatchView
from toolkit.sampling.sampler import logsumexp_rows


def temperature(logits_RV: torch.Tensor, view: BatchView) -> torch.Tensor:
    """Divide by the row's temperature (rows reach here only with temperature > 0). The column is
    expanded to the full shape: the same quotients, 3-4x faster than torch's broadcasting path here."""
    return logits_RV / view.column("temperature").expand_as(logits_RV)


def top_k(logits_RV: torch.Tensor, view: BatchView) -> torch.Tensor:
    """Keep the k largest logits of each row (ties with the k-th are kept too). fp32 CPU rows take the
    native bisection over the logits' order (toolkit/native/csrc/gumbel.c: 1.7-3 ms at 64 rows of 49,152 for
    k = 1..1,000 on the AVX-512 EPYC, where torch.topk + masked_fill took 2.9-13 ms); others torch.topk.
    Both keep the same tokens."""
    k = [min(r.params.top_k, view.vocab_size) for r in view.rows]
    native = truncate_cpu(logits_RV, "top_k", torch.tensor(k, dtype=torch.float32))
    if native is not None:
        return native[0]
    k_R = tensor_on(k, logits_RV.device)
    top_RK = torch.topk(logits_RV, max(k), dim=-1).values  # the largest k from the host's list: no device read
    kth_R1 = top_RK.gather(1, (k_R - 1).unsqueeze(1))
    return logits_RV.masked_fill(logits_RV < kth_R1, NEG_INF)


def top_p(logits_RV: torch.Tensor, view: BatchView, first_k: int | None = 256) -> torch.Tensor:
    """Keep the smallest highest-probability set whose mass reaches p: the token that crosses p is kept,
    and so are tokens tied with it. Probabilities are exp(logit - logsumexp(row)) and their running mass
    is summed in float64 down the ranking. No vocabulary-wide sort on the CPU (28 ms at 16 rows of 49,152 on
    the EPYC): fp32 rows there take the native bisection over the logits' order (mass summed in double lanes;
    toolkit/native/csrc/gumbel.c), others rank only the top of each row (torch.topk, k = 256 and 4x more for the
    rows whose mass has not reached p yet). Off the CPU each row is ranked whole, in blocks of rows: finding
    which rows are done would be a read, and a read waits for the device (a sort there is tens of
    microseconds; vLLM's top-p sorts too). `first_k=None` ranks whole rows on the CPU too."""
    native = truncate_cpu(logits_RV, "top_p", view.column("top_p").flatten())
    if native is not None:
        return native[0]
    rows, vocab = logits_RV.shape
    p_R = view.column("top_p", torch.float64).flatten()
    lse_R = logsumexp_rows(logits_RV).double()
    if first_k is None or devices.off_cpu(logits_RV):
        block = max(1, WHOLE_RANKING_ELEMENTS // vocab)
        threshold_R = torch.cat(
            [
                _crossing(logits_RV[i : i + block], lse_R[i : i + block], p_R[i : i + block], vocab)[0]
                for i in range(0, rows, block)
            ]
        )
        return logits_RV.masked_fill(logits_RV < threshold_R.unsqueeze(1), NEG_INF)
    threshold_R = torch.empty(rows, dtype=logits_RV.dtype, device=logits_RV.device)
    todo = torch.arange(rows, device=logits_RV.device)
    k = min(first_k, vocab)
    while todo.numel():
        crossing_T, done_T = _crossing(logits_RV.index_select(0, todo), lse_R[todo], p_R[todo], k)
        threshold_R[todo[done_T]] = crossing_T[done_T]
        todo, k = todo[~done_T], min(4 * k, vocab)
    return logits_RV.masked_fill(logits_RV < threshold_R.unsqueeze(1), NEG_INF)


# a whole-vocabulary ranking's rows at a time off the CPU: its float64 temporaries stay near 100 MB a block
WHOLE_RANKING_ELEMENTS = 1 << 22


def _crossing(x_TV: torch.Tensor, lse_T: torch.Tensor, p_T: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Of each row's k largest logits, the one whose running mass (float64, down the ranking) crosses p, and
    whether it was found there (True wherever k is the whole row)."""
    top_TK = torch.topk(x_TV, k, dim=-1).values  # sorted, largest first
    probs_TK = torch.exp(top_TK.double() - lse_T[:, None])
    mass_before_TK = torch.cumsum(probs_TK, dim=-1) - probs_TK  # mass of the tokens ranked above
    keep_T = (mass_before_TK < p_T[:, None]).sum(dim=-1).clamp_min(1)  # the top token always stays
    done_T = (keep_T < k) | (k == x_TV.shape[1])
    return top_TK.gather(1, (keep_T - 1).unsqueeze(1)).squeeze(1), done_T


def min_p(logits_RV: torch.Tensor, view: BatchView) -> torch.Tensor:
    """Keep tokens whose probability is at least min_p times the top token's."""
    probs_RV = torch.softmax(logits_RV, dim=-1)
    threshold_R1 = probs_RV.max(dim=-1, keepdim=True).values * view.column("min_p")
    return logits_RV.masked_fill(probs_RV < threshold_R1, NEG_INF)
