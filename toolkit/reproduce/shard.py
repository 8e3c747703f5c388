"""A recomputation sharded over Ray: `mode=audit audit.launcher=ray` and `mode=verify verify.launcher=ray`.

Every request is recomputed on its own (one no-cache forward of its prompt and tokens), so its values do not
depend on which other requests share a worker: a shard is a contiguous run of requests, balanced by tokens,
and a worker's answers are the local audit's. The driver splits the transcript into shards, hands them to one
worker per CPU it is given (a Ray actor that loads the model once and keeps each reference's forward), and
puts the answers back in shard order, so audit.json, audit.parquet and the converted trace are the local
run's, value for value and in the same order. `audit.ray.address=null` starts a local cluster of
`audit.ray.workers` CPUs; `auto` (or host:port) joins a running one.

Ray is its own extra (`pip install 'toolkit[ray]'`), imported only here, when a run asks for it.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from toolkit.config import ModelConfig, from_mapping
from toolkit.errors import ClusterError, ConfigError, one_line
from toolkit.models import load_model

LAUNCHERS = ("local", "ray")


@dataclass(frozen=True)
class RayOptions:
    address: str | None = None  # None: a local cluster; "auto" or host:port: a running one
    workers: int = 2  # actors (one CPU each)
    shards_per_worker: int = 4  # more shards than workers: a slow one does not hold the rest back
    threads: int = 1  # torch threads in each worker


def ray_options(a: dict, section: str = "audit") -> RayOptions:
    """<section>.ray checked: a one-line error naming the field."""
    given = a.get("ray") or {}
    if not isinstance(given, Mapping):
        raise ConfigError(
            f"{section}.ray must be a mapping of address, workers, shards_per_worker, threads, got {given!r}"
        )
    r = dict(given)
    unknown = sorted(set(r) - {"address", "workers", "shards_per_worker", "threads"})
    if unknown:
        raise ConfigError(f"{section}.ray: unknown keys {unknown}; known: address, workers, shards_per_worker, threads")
    options = RayOptions(**r)
    for name in ("workers", "shards_per_worker", "threads"):
        value = getattr(options, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{section}.ray.{name} must be a positive integer, got {value!r}")
    if options.address is not None and not isinstance(options.address, str):
        raise ConfigError(f"{section}.ray.address must be null, auto or host:port, got {options.address!r}")
    return options


def launcher(a: dict, section: str = "audit") -> str:
    name = a.get("launcher", "local")
    if name not in LAUNCHERS:
        raise ConfigError(f"{section}.launcher must be one of {', '.join(LAUNCHERS)}, got {name!r}")
    return name


def split(weights: Sequence[int], shards: int) -> list[range]:
    """Contiguous ranges of indices covering them all, at most `shards` of them, a shard closed where the
    running weight first reaches the next equal share of the total (so none exceeds a share by more than one
    item's weight)."""
    n, total = len(weights), sum(weights)
    shards = max(1, min(shards, n))
    bounds, seen, k = [0], 0, 1
    for i, w in enumerate(weights):
        seen += w
        if k < shards and seen >= total * k / shards:
            bounds.append(i + 1)
            k += 1
    bounds.append(n)
    return [range(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def in_order(results: dict[int, list[list]], width: int) -> list[list]:
    """Shards' answers (shard index -> per column, a list), arrived in any order, joined per column in shard
    order: the local run's order."""
    return [[item for k in sorted(results) for item in results[k][j]] for j in range(width)]


def progress_bar(total: int, what: str):
    """tqdm on a terminal (tokens/s and ETA), nothing otherwise."""
    from tqdm import tqdm  # deferred: tqdm, a progress bar only

    return tqdm(
        total=total,
        unit="tok",
        unit_scale=True,
        desc=what,
        disable=not sys.stderr.isatty(),
        file=sys.stderr,
        leave=False,
    )


class _Worker:
    """One Ray actor: the model loaded once; each shard handed to the function the caller names, with the model
    and a memo that outlives the shard (each reference's forward made once)."""

    def __init__(self, model_cfg: dict[str, Any], threads: int):

        torch.set_num_threads(threads)
        self.loaded = load_model(from_mapping(ModelConfig, model_cfg, section="model"), "cpu")
        self.memo: dict[str, Any] = {}

    def run(self, index: int, work: Callable, args: tuple) -> tuple[int, Any]:
        return index, work(self.loaded, self.memo, *args)


def run_on_ray(
    model_cfg: dict[str, Any],
    options: RayOptions,
    weights: list[int],
    what: str,
    work: Callable,
    args_of: Callable[[range], tuple],
) -> dict[int, Any]:
    """The items cut into shards by weight, each done by a Ray worker as `work(loaded, memo, *args_of(shard))`
    (`work` a module-level function: Ray sends it by name); shard index -> answer, in the order they arrived."""
    try:
        import ray  # deferred: ray, the [ray] extra
        from ray.util import ActorPool  # deferred: ray, the [ray] extra
    except ModuleNotFoundError:
        raise ConfigError(f"{what}.launcher=ray needs Ray: pip install 'toolkit[ray]'") from None
    started = not ray.is_initialized()
    if started:
        kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False, "logging_level": "ERROR"}
        if options.address is None:
            kwargs["num_cpus"] = options.workers * options.threads
        else:
            check_reachable(options.address, what)
        try:
            ray.init(address=options.address, **kwargs)
        except Exception as exc:  # noqa: BLE001 - ray raises ConnectionError, RuntimeError, ValueError by case
            raise ClusterError(
                f"{what}.ray.address={options.address}: cannot join that Ray cluster: {one_line(exc)}"
            ) from None
    try:
        shards = split(weights, options.workers * options.shards_per_worker)
        workers = placeable(ray.cluster_resources().get("CPU", 0), options, len(shards), what)
        actor = ray.remote(num_cpus=options.threads)(_Worker)
        pool = ActorPool([actor.remote(model_cfg, options.threads) for _ in range(workers)])
        results: dict[int, Any] = {}
        with progress_bar(sum(weights), f"{what} on Ray") as bar:
            for k, shard in enumerate(shards):
                pool.submit(lambda w, job: w.run.remote(job[0], work, args_of(job[1])), (k, shard))
            while pool.has_next():
                try:
                    index, answer = pool.get_next_unordered()
                except ray.exceptions.RayError as exc:  # a worker died (killed, out of memory), or its node
                    raise ClusterError(f"{what} on Ray: a worker failed: {one_line(exc)}") from None
                results[index] = answer
                bar.update(sum(weights[i] for i in shards[index]))
        return results
    finally:
        if started:
            ray.shutdown()


def check_reachable(address: str, what: str, timeout_s: float = 5.0) -> None:
    """A ClusterError where nothing answers at a host:port address (ray.init retried such an address for ever);
    `auto` and an address without a port are left to Ray."""
    host, _, port = address.rpartition("://")[2].rpartition(":")
    if not host or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ClusterError(f"{what}.ray.address={address}: no Ray cluster answers there ({reason})") from None


def placeable(cpus: float, options: RayOptions, shards: int, what: str) -> int:
    """How many workers of `options.threads` CPUs each the cluster can place at once (an actor it can never place
    waited for ever, silently): at most `options.workers`, one a shard; a ClusterError where not even one fits."""
    fits = int(cpus // options.threads)
    if fits < 1:
        raise ClusterError(
            f"{what}.ray.threads={options.threads}: a worker asks for {options.threads} CPUs, and the Ray cluster has "
            f"{cpus:g}; lower it"
        )
    workers = min(options.workers, shards, fits)
    if workers < min(options.workers, shards):
        print(
            f"toolkit: the Ray cluster has {cpus:g} CPUs: {workers} workers of {options.threads} threads, "
            f"not {options.workers}",
            file=sys.stderr,
        )
    return workers
