"""Gradient-evidence hooks run on autograd's device threads too (CUDA backward), where only a
frame or two of Python sit above the hook: walking up the stack must not raise there (on the
H200 the evidence stopped with "ValueError: call stack is not deep enough")."""

from __future__ import annotations

import _thread
import threading

from graphdeck.capture.grad_evidence import _checkpoint_site, _nested


def test_stack_walks_on_a_thread_with_no_python_caller():
    done = threading.Event()
    out: list = []

    def hook():  # the only Python frame of this thread, as a hook called from C++
        try:
            out.append((_nested(), _checkpoint_site()))
        except Exception as exc:  # noqa: BLE001 - the failure this test is about
            out.append(exc)
        done.set()

    _thread.start_new_thread(hook, ())
    assert done.wait(10)
    assert out == [(False, None)], out
