"""Foreign native code runs in a child process (toolkit.native.child): a child killed by a real signal, one that
raises, one that hangs and one that returns are each told apart, in one line, and the caller goes on."""

from __future__ import annotations

import ctypes
import os
import time

import psutil
import pytest

from toolkit.audit.sources import llama_cpp_missing, llama_cpp_transcript
from toolkit.errors import ForeignEngineError
from toolkit.native.child import run_in_child


def test_a_child_that_returns_gives_its_result():
    assert run_in_child(divmod, 17, 5, what="divmod") == (3, 2)


def test_a_segfault_in_the_child_is_an_error_naming_the_signal():
    with pytest.raises(ForeignEngineError, match=r"^llama.cpp crashed: killed by signal SIGSEGV \(11\)"):
        run_in_child(ctypes.string_at, 0, what="llama.cpp")  # reads address 0: a real SIGSEGV
    assert run_in_child(divmod, 1, 1, what="after") == (1, 0)  # and the caller goes on


def test_an_abort_in_the_child_is_sigabrt():
    with pytest.raises(ForeignEngineError, match=r"killed by signal SIGABRT \(6\)"):
        run_in_child(os.abort, what="llama.cpp")


def test_an_exception_in_the_child_is_its_message_on_one_line():
    with pytest.raises(ForeignEngineError) as err:
        run_in_child(int, "not a number", what="parser")
    assert str(err.value).startswith("parser failed: ValueError: invalid literal for int()")
    assert "\n" not in str(err.value)


def test_an_exit_without_a_result_is_named():
    with pytest.raises(ForeignEngineError, match=r"exited with code 3 in its child process without a result"):
        run_in_child(os._exit, 3, what="engine")


def test_a_child_past_its_timeout_is_killed():
    before = {p.pid for p in psutil.Process().children()}
    start = time.monotonic()
    with pytest.raises(ForeignEngineError, match=r"ran past its 1 s timeout and was killed"):
        run_in_child(time.sleep, 60, what="sleeper", timeout=1)
    assert time.monotonic() - start < 30
    assert {p.pid for p in psutil.Process().children()} <= before  # no child left behind


def test_llama_cpp_failing_in_its_child_is_an_error_of_the_caller(tmp_path):
    if reason := llama_cpp_missing():
        print(f"SKIP reason: {reason}")
        pytest.skip(reason)
    with pytest.raises(ForeignEngineError, match=r"^llama.cpp failed: ValueError: .*missing.gguf"):
        llama_cpp_transcript(tmp_path / "out.jsonl", tmp_path / "missing.gguf", [[1, 2, 3]], max_tokens=2)
    assert not (tmp_path / "out.jsonl").exists()
