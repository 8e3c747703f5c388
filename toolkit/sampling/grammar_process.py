"""Grammars tried in a child process first (a server's): xgrammar's compile is foreign native code whose time and
memory a client's schema sets, so a new grammar is compiled first where a deadline kills it, an address-space
limit bounds it, and a crash costs one request its answer, never the server its life. Only a grammar that compiled
there, in time and memory, is compiled again in the server's process (GrammarBackend.compile): xgrammar's
compile is deterministic, so that second compile takes what the first did. (Its serialized CompiledGrammar is no
way back: for an object of n required properties it grows as n^2, 97 MB and 5.8 s to write at n=600, where the
compile takes 0.05 s.)

    process = GrammarProcess(memory_mb=1024)       # one per compiling thread; its child starts at first use
    process.compile_into(backend, spec, timeout_s=10, on_start=...)   # TimeoutError past it (the child killed)
    process.close()                                 # the child killed, whatever it runs

Children fork from multiprocessing's fork server with xgrammar (and torch, which it imports) loaded once, so a
child killed at its deadline is replaced in a fraction of a second, not the seconds of a fresh interpreter's
imports; the fork server is a fresh interpreter of its own, so nothing of the server's threads is forked.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import resource
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from toolkit.errors import RequestError, ResourceError, ToolkitError, one_line
from toolkit.native.child import exit_reason
from toolkit.sampling.grammar import GrammarBackend, StructuredOutputs, compile_spec, out_of_memory, unpack_bitmask

__all__ = ["GrammarProcess", "prestart"]

START_TIMEOUT_S = 120.0  # a child's start: the fork server's imports (seconds) on a loaded machine


def _context():
    ctx = multiprocessing.get_context("forkserver")
    # applies when this process's fork server starts; with __main__ among them a child does not import it again
    ctx.set_forkserver_preload(["__main__", "xgrammar", __name__])
    return ctx


def prestart() -> None:
    """Start this process's fork server now (its imports take seconds), not at the first grammar's compile; a
    failure is left for that compile to meet and name."""
    try:
        _context()
        multiprocessing.forkserver.ensure_running()
    except Exception:  # noqa: BLE001, S110 - GrammarProcess._started says what it was, as a 503
        pass


def _vm_bytes() -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmSize:"))
    return int(line.split()[1]) * 1024


def _serve(conn, info_json: str, memory_mb: int | None) -> None:
    """The child: compile each (kind, text) it is sent; answer ("ok", retire), ("memory", None) or ("error",
    ToolkitError). `retire`: its address space grew past half its allowance (the allocator's leftovers), so the
    parent replaces it before a compile is refused for what earlier ones left."""
    import xgrammar as xgr  # deferred: preloaded in the fork server

    info = xgr.TokenizerInfo.deserialize_json(info_json)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    del info_json
    warnings = tempfile.TemporaryFile()  # xgrammar's C++ log: what it warns of as it compiles (one thread here)
    stderr = os.dup(2)
    base = _vm_bytes()
    if memory_mb is not None:  # what its compiles may add to the address space it has now
        resource.setrlimit(resource.RLIMIT_AS, (base + (memory_mb << 20),) * 2)
    conn.send(("ready", None))
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):  # the parent closed the pipe, or is gone
            return
        try:
            kind, text = message[:8].decode().strip(), message[8:].decode()
            del message
            warnings.seek(0)
            warnings.truncate()
            os.dup2(warnings.fileno(), 2)
            try:
                compiled = compile_spec(compiler, kind, text)
            finally:
                os.dup2(stderr, 2)
            warnings.seek(0)
            warned = _warning(warnings.read(1 << 16).decode(errors="replace"))
            if warned is not None:  # a construct it compiled without holding the output to it
                raise RequestError(f"invalid structured_outputs.{kind}: xgrammar would not enforce it: {warned}")
            _check_first_token(xgr, compiled, kind)
            del compiled
            answer = ("ok", memory_mb is not None and _vm_bytes() - base > (memory_mb << 19))
        except ToolkitError as exc:
            answer = ("error", exc)
        except Exception as exc:  # noqa: BLE001 - past its memory limit; else xgrammar's own failure, one line
            why = RequestError(f"invalid structured_outputs.{kind}: xgrammar failed compiling it: {one_line(exc)}")
            answer = ("memory", None) if out_of_memory(exc) else ("error", why)
        conn.send(answer)


def _check_first_token(xgr, compiled, kind: str) -> None:
    """A RequestError when the grammar lets no first token through (a `$ref` cycle that never reaches a value:
    every request with it ended at once, finish_reason "error"), or, for JSON, only a stop token (`anyOf: []`: an
    empty text, which is no JSON)."""
    info = compiled.tokenizer_info
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask)
    allowed = unpack_bitmask(bitmask, info.vocab_size)[0]
    if not allowed.any():
        raise RequestError(
            f"invalid structured_outputs.{kind}: no text satisfies it (its grammar allows no first token)"
        )
    allowed[[t for t in info.stop_token_ids if t < info.vocab_size]] = False
    if kind == "json" and not allowed.any():
        raise RequestError("invalid structured_outputs.json: only an empty text satisfies it, and that is no JSON")


# what xgrammar warns of and the server takes all the same: a oneOf it cannot prove disjoint is read as anyOf (a
# pydantic discriminated union, its branches behind $refs, is one; docs/decoding.md)
TOLERATED = ("oneOf with overlapping or non-provably-disjoint branches",)


def _warning(log: str) -> str | None:
    """The first warning in xgrammar's log not TOLERATED, without its time and source location."""
    for line in log.splitlines():
        if "Warning:" in line:
            warning = line.split("Warning:", 1)[1].strip()
            if not warning.startswith(TOLERATED):
                return warning[:300]
    return None


class GrammarProcess:
    """A child process trying grammars for one tokenizer, one at a time; used by one thread (close() by any)."""

    def __init__(self, memory_mb: int | None = None):
        self.memory_mb = memory_mb
        self._proc: Any = None
        self._conn: Any = None
        self._lock = threading.Lock()  # close() against the thread's start and kill
        self._closed = False

    def compile_into(
        self,
        backend: GrammarBackend,
        spec: StructuredOutputs,
        timeout_s: float,
        on_start: Callable[[], None] = lambda: None,
    ) -> None:
        """Compile `spec` in the child, then, if it compiled there, into `backend`'s cache on this thread.
        `timeout_s` bounds the child's compile, counted from its start (`on_start` is called then), not the
        child's start: past it the child is killed and TimeoutError raised. A RequestError names what is wrong
        with the grammar (its memory past `memory_mb` too), a ResourceError what the machine lacked."""
        conn = self._started(backend)
        on_start()
        try:
            conn.send_bytes(f"{spec.kind:8}{spec.text}".encode())  # what the child decodes, whole or not at all
            answered = conn.poll(timeout_s)
            status, value = conn.recv() if answered else (None, None)
        except (EOFError, OSError):  # the child died compiling it, or close() killed it
            exitcode = self._replace(backend)
            if self._closed:
                raise ResourceError("the grammar compiler was closed (the server is stopping)") from None
            raise RequestError(
                f"invalid structured_outputs.{spec.kind}: xgrammar's compile of it {exit_reason(exitcode)}"
            ) from None
        if not answered:
            self._replace(backend)
            raise TimeoutError(f"compiling structured_outputs.{spec.kind} took longer than {timeout_s:g} s")
        if status == "memory":
            self._replace(backend)  # whatever it holds now is not worth keeping
            raise RequestError(
                f"invalid structured_outputs.{spec.kind}: compiling its grammar needs more than "
                f"{self.memory_mb} MB (serve.max_grammar_mb)"
            )
        if status == "error":
            raise value
        if value:  # retire it: the next compile gets a fresh one
            self._replace(backend)
        backend.compile(spec)

    def _started(self, backend: GrammarBackend):
        with self._lock:
            if self._closed:
                raise ResourceError("the grammar compiler was closed (the server is stopping)")
            if self._proc is not None and self._proc.is_alive():
                return self._conn
            ctx = _context()
            parent, child = ctx.Pipe()
            try:
                proc = ctx.Process(
                    target=_serve,
                    args=(child, backend.tokenizer_info_json(), self.memory_mb),
                    name="grammar compiler",
                    daemon=True,
                )
                proc.start()
            except (OSError, RuntimeError) as exc:  # RuntimeError: multiprocessing's (a script without a main guard)
                raise ResourceError(f"the grammar compiler's process could not start: {one_line(exc)}") from None
            finally:
                child.close()
            self._proc, self._conn = proc, parent
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            while not parent.poll(0.05):
                if not proc.is_alive() or time.monotonic() > deadline:
                    raise EOFError
            parent.recv()
        except (EOFError, OSError):
            exitcode = self._kill()
            raise ResourceError(f"the grammar compiler's process did not start: it {exit_reason(exitcode)}") from None
        return parent

    def _replace(self, backend: GrammarBackend) -> int | None:
        """Kill the child and start the next one now (its start is off the next compile's path): the exit code."""
        exitcode = self._kill()
        try:
            self._started(backend)
        except ResourceError:  # closed, or it could not start: the next compile tries again, and says so
            pass
        return exitcode

    def _kill(self) -> int | None:
        """Kill the child (if any) and forget it; its exit code."""
        with self._lock:
            proc, conn, self._proc, self._conn = self._proc, self._conn, None, None
        if proc is None:
            return None
        proc.kill()
        proc.join()
        conn.close()
        return proc.exitcode

    def pid(self) -> int | None:
        """The child's process id, if one is alive."""
        proc = self._proc
        return proc.pid if proc is not None and proc.is_alive() else None

    def close(self) -> None:
        """Kill the child whatever it runs: a compile waiting on it ends with a ResourceError at once (its thread
        forgets the child and closes the pipe, which it may be polling)."""
        with self._lock:
            self._closed = True
            if self._proc is not None:
                self._proc.kill()
