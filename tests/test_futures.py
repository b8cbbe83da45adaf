"""rrpc.futures without processes: where callbacks run, and torch's semantics of then()."""

from __future__ import annotations

import threading

import pytest
import torch

from rrpc import futures, messages
from rrpc.futures import Future


def _on_a_transport_thread(fn, *args):
    """Run fn on a thread marked as one the transport needs (a stream's reader)."""
    result = {}

    def run():
        messages.mark_transport_thread()
        result["thread"] = threading.current_thread()
        fn(*args)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(10)
    return result["thread"]


def test_callbacks_of_a_future_completed_on_a_transport_thread_run_elsewhere_every_time():
    # 200 completions in a row: each callback runs, none on the transport thread.
    for i in range(200):
        future = Future()
        ran_on = []
        child = future.then(
            lambda fut, seen=ran_on: seen.append(threading.current_thread()) or fut.value()
        )
        transport = _on_a_transport_thread(futures.settle, future, i)
        assert child.wait() == i
        assert ran_on and ran_on[0] is not transport


def test_a_callback_may_wait_for_work_that_another_callback_does():
    # The first callback blocks until the second has run: with a fixed number
    # of callback threads this could deadlock; the pool adds a thread instead.
    first, second = Future(), Future()
    handoff = threading.Event()
    chained = first.then(lambda fut: handoff.wait(10) and fut.value() + 1)
    second.add_done_callback(lambda fut: handoff.set())
    _on_a_transport_thread(futures.settle, first, 1)
    _on_a_transport_thread(futures.settle, second, 2)
    assert chained.wait() == 2


def test_a_callback_on_a_user_thread_runs_right_there_as_in_torch():
    future = Future()
    future.set_result(3)
    seen = []
    future.add_done_callback(lambda fut: seen.append(threading.current_thread()))
    assert seen == [threading.current_thread()]


def test_an_error_in_a_then_callback_is_torchs_runtime_error_naming_it():
    plain, ours = torch.futures.Future(), Future()
    children = [f.then(lambda fut: fut.value() + "text") for f in (plain, ours)]
    plain.set_result(1)
    ours.set_result(1)
    messages = []
    for child in children:
        with pytest.raises(RuntimeError) as error:
            child.wait()
        messages.append(str(error.value).splitlines()[0])
    assert (
        messages[0]
        == messages[1]
        == (
            "Got the following error when running the callback: TypeError: unsupported operand "
            "type(s) for +: 'int' and 'str'"
        )
    )


def test_then_needs_a_callable_as_in_torch():
    with pytest.raises(TypeError, match="incompatible function arguments"):
        Future().then(None)


def test_wait_raises_a_copy_of_the_error_so_the_future_holds_no_frame():
    future = Future()
    future.set_exception(ValueError("boom"))
    raised = []
    for _ in range(2):
        with pytest.raises(ValueError, match="boom") as error:
            future.wait()
        raised.append(error.value)
    assert raised[0] is not raised[1]


def _torch_future_calls(monkeypatch) -> list[str]:
    """Record every call to torch's Future methods that let go of the GIL."""
    calls: list[str] = []
    for name in ("add_done_callback", "then", "value", "wait"):
        original = getattr(torch.futures.Future, name)

        def recorded(self, *args, _name=name, _original=original):
            calls.append(_name)
            return _original(self, *args)

        monkeypatch.setattr(torch.futures.Future, name, recorded)
    return calls


def test_callbacks_and_outcome_are_kept_in_python_not_asked_of_torch(monkeypatch):
    # Each of these torch methods lets go of the GIL, which costs up to 5 ms to
    # get back while another thread runs Python: rrpc's futures answer them
    # from their own state once completed through rrpc (as rrpc completes them).
    calls = _torch_future_calls(monkeypatch)
    future, order = Future(), []
    future.add_done_callback(lambda fut: order.append(("before", fut.value())))
    child = future.then(lambda fut: fut.wait() + 1)
    _on_a_transport_thread(futures.settle, future, 41)
    assert calls == []
    assert child.wait() == 42  # done on the callback thread: a wait for it may block in torch
    calls.clear()
    future.add_done_callback(lambda fut: order.append(("after", fut.value())))
    assert (future.value(), future.wait()) == (41, 41)
    assert order == [("before", 41), ("after", 41)]  # registration order, as in torch
    failed = Future()
    failed.add_done_callback(lambda fut: order.append(futures.outcome(fut)))
    failed.set_exception(ValueError("boom"))
    with pytest.raises(ValueError, match="boom"):
        failed.value()
    value, error = order[-1]  # the callback saw the error, not a value
    assert value is None and isinstance(error, ValueError) and str(error) == "boom"
    assert calls == []


def test_internal_callbacks_on_an_rrpc_future_run_in_order_with_the_users_without_torch(
    monkeypatch,
):
    # Registered with torch, the internal ones would run first, both, then the user's.
    calls = _torch_future_calls(monkeypatch)
    future, order = Future(), []
    futures.on_done(future, lambda fut: order.append("internal 1"))
    future.add_done_callback(lambda fut: order.append("user"))
    futures.on_done(future, lambda fut: order.append(("internal 2", fut.value())))
    combined = futures.all_of([future])
    future.set_result(7)
    assert order == ["internal 1", "user", ("internal 2", 7)]
    assert combined.done() and calls == []


def test_a_callback_that_raises_is_logged_and_stops_neither_the_others_nor_the_completer(caplog):
    future, order = Future(), []

    def fails(fut):
        raise ValueError("in a callback")

    futures.on_done(future, fails)
    futures.on_done(future, lambda fut: order.append(fut.value()))
    future.set_result(5)  # the completing thread (a stream's reader) goes on
    futures.on_done(future, fails)  # registered once done: runs at once, logged likewise
    assert order == [5]
    assert [r.exc_info[1].args for r in caplog.records if r.exc_info] == [("in a callback",)] * 2


def test_a_future_completed_through_rrpc_still_completes_torchs_own_waits():
    # The torch future underneath is completed first: torch's combinators and
    # C++ callbacks see it, and a thread already waiting wakes.
    futures_ = [Future(), Future()]
    collected = torch.futures.collect_all(futures_)
    waiting = threading.Thread(target=futures_[0].wait)
    waiting.start()
    _on_a_transport_thread(futures.settle, futures_[0], "a")
    futures_[1].set_result("b")
    waiting.join(10)
    assert not waiting.is_alive()
    assert [done.value() for done in collected.wait()] == ["a", "b"]
    assert torch.futures.wait_all(futures_) == ["a", "b"]
    failed = Future()
    failed.set_exception(ValueError("c"))
    with pytest.raises(ValueError, match="c"):
        torch.futures.wait_all([failed])


# -- Combinations -------------------------------------------------------------------


def test_all_of_fails_at_the_first_failure_before_the_others_are_done():
    first, second = torch.futures.Future(), torch.futures.Future()
    combined = futures.all_of([first, second])
    first.set_exception(ValueError("first"))
    assert combined.done()  # second is still pending
    with pytest.raises(ValueError, match="first"):
        combined.wait()
    second.set_result(2)  # completing the rest changes nothing
    assert futures.all_of([]).done()


def test_all_settled_never_fails_and_reports_each_failure():
    parts = [torch.futures.Future() for _ in range(3)]
    errors: list[BaseException] = []
    combined = futures.all_settled(parts, errors.append)
    parts[0].set_exception(KeyError("a"))
    parts[1].set_result(1)
    assert not combined.done()
    parts[2].set_exception(KeyError("b"))
    assert combined.wait() is None
    assert [str(error) for error in errors] == ["'a'", "'b'"]


def _complete_together(go, future, error, raised):
    go.wait()
    try:
        future.set_exception(error) if error else future.set_result(1)
    except BaseException as exc:  # e.g. the combination completed twice
        raised.append(exc)


def test_a_failure_and_the_last_success_racing_complete_the_combination_once():
    for _ in range(200):
        failing, succeeding = torch.futures.Future(), torch.futures.Future()
        combined = futures.all_of([failing, succeeding])
        go, raised = threading.Barrier(2), []
        threads = [
            threading.Thread(
                target=_complete_together, args=(go, failing, ValueError("lost"), raised)
            ),
            threading.Thread(target=_complete_together, args=(go, succeeding, None, raised)),
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        assert raised == []
        with pytest.raises(ValueError, match="lost"):
            combined.wait()


def test_a_callback_added_by_a_waiter_its_completion_woke_runs_at_once_on_the_waiter():
    # torch wakes a future's waiters before it runs its C++ callbacks; one of
    # those holds the completing thread until the woken waiter has added its
    # callback. The future is done for the waiter: the callback runs there, at once.
    future = Future()
    added = threading.Event()
    torch.futures.Future.add_done_callback(future, lambda _: added.wait(10))
    ran_on = []

    def waiter():
        future.wait()
        future.add_done_callback(lambda _: ran_on.append(threading.current_thread().name))
        added.set()

    thread = threading.Thread(target=waiter, name="waiter")
    thread.start()
    future.set_result(5)
    thread.join(10)
    assert ran_on == ["waiter"] and future.done() and future.wait() == 5


def test_a_future_completed_twice_raises_and_keeps_its_first_outcome():
    future = Future()
    future.set_result(1)
    with pytest.raises(RuntimeError):
        future.set_result(2)
    with pytest.raises(RuntimeError):
        future.set_exception(ValueError("late"))
    assert future.wait() == 1
    with pytest.raises(AssertionError):  # as torch: only an Exception
        Future().set_exception("not an exception")  # type: ignore[arg-type]
