"""The public functions: init_rpc, shutdown, rpc_sync, rpc_async, get_worker_info.

Arguments are checked here, once; everything else happens in the agent.
"""

from __future__ import annotations

import atexit
import contextlib
import enum
import math
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from rrpc import agent as agent_module
from rrpc import membership, worker
from rrpc.agent import Agent, current_agent
from rrpc.faults import FaultyRpcBackendOptions
from rrpc.functions import naming
from rrpc.messages import CALL, Description, RpcError, WorkerInfo
from rrpc.options import UNSET_RPC_TIMEOUT, RpcBackendOptions
from rrpc.rendezvous import Rendezvous, advertise_host, resolve_world


class BackendType(enum.Enum):
    """Accepted for compatibility with ``torch.distributed.rpc.BackendType``."""

    TENSORPIPE = "TENSORPIPE"
    GRPC = "GRPC"
    FAULTY_TENSORPIPE = "FAULTY_TENSORPIPE"  # with rrpc.FaultyRpcBackendOptions (faults.py)


_lock = threading.Lock()
_thread_local_var = threading.local()  # future_list: see _wait_all


def init_rpc(
    name: str,
    backend: Any = None,
    rank: int | None = None,
    world_size: int | None = None,
    rpc_backend_options: RpcBackendOptions | None = None,
) -> None:
    """Start this process's RPC agent and wait until all workers have joined.

    Args:
        name: a unique name for this worker, e.g. ``"trainer0"``.
        backend: ignored; accepted so that code written for PyTorch runs unchanged.
        rank: this worker's rank in ``[0, world_size)``; default: ``$RANK``.
        world_size: number of workers; default: ``$WORLD_SIZE``. When neither
            is set, membership is dynamic: workers may join at any time (rank 0,
            which hosts the store, joins first and leaves last).
        rpc_backend_options: an ``rrpc.RpcBackendOptions`` (timeouts, threads,
            auth token, advertised host, ...).

    The store used to find the other workers is at MASTER_ADDR:MASTER_PORT
    (hosted by rank 0, or by torchrun's agent), as ``torchrun`` sets them.

    Example::

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
        rrpc.init_rpc("worker0", rank=0, world_size=2)
        print(rrpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1)))
        rrpc.shutdown()
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"worker name must be a non-empty string, not {name!r}")
    WorkerInfo(name, 0)  # raises as torch for a name it would refuse
    if backend is not None and type(backend).__name__ != "BackendType":
        raise TypeError(
            f"Argument backend must be a member of BackendType (rrpc.BackendType or "
            f"torch's), not {backend!r}"
        )
    options = rpc_backend_options or RpcBackendOptions()
    if backend is None and type(options) not in (RpcBackendOptions, FaultyRpcBackendOptions):
        # torch infers the backend from the options' exact class
        raise TypeError(f"Could not infer backend for options {options!r}")
    if not isinstance(options, RpcBackendOptions):
        raise TypeError(
            "Argument rpc_backend_options must be an instance of RpcBackendOptions "
            f"(rrpc.RpcBackendOptions), not {type(options).__name__}"
        )
    if rank is not None and rank < 0:
        rank = None  # torch's "unset" default is -1
    with _lock:
        if agent_module._current is not None:
            raise RpcError("RPC is already initialized in this process; call rrpc.shutdown() first")
        rank, world_size, store_host, store_port = resolve_world(
            rank, world_size, options.init_method
        )
        rendezvous = Rendezvous(rank, world_size, store_host, store_port, options.init_timeout)
        agent = None
        group = None  # a dynamic group's membership (rrpc/membership.py)
        try:
            agent = Agent(name, rank, advertise_host(store_host, options.advertise_host), options)
            if world_size is None:
                group = membership.Group(rendezvous, rank)
                agent.incarnation = group.next_incarnation()
            # Every handler is in place before any peer can learn our address.
            worker.start_services(agent)
            if group is not None:
                group.join(agent)  # by the rendezvous's deadline: init_timeout
                agent.peers.lookup = group.lookup
            else:
                for info, address, advertised in rendezvous.exchange(
                    name, agent.address, agent.advertisement()
                ):
                    agent.add_peer(info, address, advertised)
        except BaseException:
            if agent is not None:
                agent.stop(graceful=False)
                worker.stop_services(agent)
            rendezvous.close(timeout=0)
            raise
        agent.rendezvous = rendezvous
        agent_module.set_current_agent(agent)
        agent.ready.set()  # requests that came in meanwhile run from now on
        _stop_before_threads_are_joined()
        if group is not None:
            group.announce()


def shutdown(graceful: bool = True, timeout: float = 0) -> None:
    """Stop this worker's agent.

    With ``graceful=True`` (the default) it first waits until every worker has
    called ``shutdown`` and none has calls, RRef messages or autograd work
    still in flight, so no worker leaves while others depend on it. As in
    PyTorch, ``timeout=0`` (the default) waits as long as the others work;
    unlike PyTorch, a worker that died is noticed and not waited for. With
    ``graceful=False`` it stops at once and fails its pending calls.
    Afterwards ``init_rpc`` may be called again.

    In a dynamic group (no world size) a worker leaves alone while the others
    go on: it lets go of its RRefs, waits for its own calls and for those the
    others have on it, then leaves (see ``rrpc/membership.py``). A worker that
    cannot reach the rendezvous store logs it and raises ``RpcError`` (having
    stopped). Every step shares one deadline: ``shutdown(timeout=T)`` returns
    or raises within T plus at most 1 s, beside a frozen peer or store too
    (past T only the barrier's last look at who is missing, up to 0.5 s, the
    run's threads finishing, up to 0.25 s, and leaving the store, up to
    0.25 s, or 0.5 s on the store's host, which keeps the store 0.25 s for
    ranks that have not left it yet; with a store that answers and nothing
    left running, milliseconds).
    """
    with _lock:
        agent = agent_module._current
        if agent is None:
            raise RpcError("RPC has not been initialized: nothing to shut down")
        rendezvous = agent.rendezvous
        # One deadline for every step, so that shutdown(timeout=T) ends within T.
        deadline = time.monotonic() + timeout if timeout > 0 else math.inf
        group = agent.group  # a dynamic group's membership, while joined
        left = False
        try:
            if graceful:
                worker.drain_services(agent, _remaining(deadline))
                if not agent.wait_idle(_remaining(deadline)):
                    raise RpcError(
                        f"shutdown of {agent.info.name}: calls still pending after {timeout:g} s"
                    )
                if group is not None:
                    left = True
                    group.leave(deadline, graceful=True)
                elif rendezvous is not None:
                    # Peers that pass the barrier first stop: a late send (an
                    # RRef's DELETE) that meets their closed lane is no news.
                    # (A peer that dies meanwhile, the barrier finds and logs.)
                    agent.leaving = True
                    rendezvous.barrier(
                        "shutdown",
                        timeout,
                        gone=agent.all_unreachable,
                        suspects=agent.suspects,
                        deadline=deadline,
                    )
        finally:
            if group is not None and not left:
                with contextlib.suppress(RpcError):
                    group.leave(deadline, graceful=False)
            # Stopping shares the deadline: streams close gracefully until it (5 s
            # at most), and the run's threads (the agent's, then the services')
            # end by then too, or by STOP_GRACE from now if that is later.
            closing = min(5.0, _remaining(deadline)) if graceful else 0.0
            until = time.monotonic() + max(closing, agent_module.STOP_GRACE)
            agent.stop(graceful, closing, until)
            worker.stop_services(agent, until)
            agent_module.set_current_agent(None)
            agent.rendezvous = None
            if rendezvous is not None:
                rendezvous.close(timeout=min(10.0, _remaining(deadline)) if graceful else 0.0)


def _remaining(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic()) if deadline != math.inf else math.inf


@atexit.register
def _stop_at_exit() -> None:
    # An agent left running at exit would hang in gRPC's channel finalizers.
    if agent_module._current is not None:
        shutdown(graceful=False)


_registered_before_joins = False


def _stop_before_threads_are_joined() -> None:
    """Make a script that ends without ``shutdown()`` (an exception, a forgotten
    call) exit, and its peers notice: stop the agent before the interpreter
    joins the gRPC server's threads, which wait on the agent's streams.
    ``atexit`` runs after that join, too late; threading's own exit hooks run
    before it, latest registered first (after concurrent.futures' join, which
    the first Agent's server has registered by now)."""
    global _registered_before_joins
    if _registered_before_joins:
        return
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        register(_stop_at_exit)
        _registered_before_joins = True


def rpc_async(
    to: Any,
    func: Callable[..., Any],
    args: tuple | None = None,
    kwargs: dict | None = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> torch.futures.Future:
    """Run ``func(*args, **kwargs)`` on worker ``to``; return a Future of its result.

    Args:
        to: the callee's name, rank or ``WorkerInfo``.
        func: a builtin (``torch.add``), any picklable callable, or a lambda /
            closure (sent by value with cloudpickle). A function of the script
            itself (``__main__``) goes by name to a worker running the same
            script, as in torch, and by value to any other.
        args, kwargs: its arguments; tensors travel as raw buffers.
        timeout: seconds; -1 uses ``rpc_timeout`` of the options, 0 waits forever.

    The future raises the callee's exception (its own type, with the remote
    traceback attached as a note), ``rrpc.RpcTimeoutError`` after ``timeout``,
    or ``rrpc.PeerUnavailableError`` as soon as the callee is known dead.

    Example::

        fut = rrpc.rpc_async("worker1", torch.add, args=(torch.ones(2), 3))
        fut.wait()  # tensor([4., 4.])
    """
    future = _send_call(to, func, args, kwargs, timeout, sync=False)
    collected = getattr(_thread_local_var, "future_list", None)
    if collected is not None:
        collected.append(future)
    return future


@contextlib.contextmanager
def _wait_all() -> Iterator[None]:
    """Wait, when the block ends, for every future ``rpc_async`` returned in it
    (torch's private helper of the same name).

    Example::

        with rrpc.api._wait_all():
            rrpc.rpc_async("worker1", torch.add, args=(torch.ones(2), 1))
    """
    _thread_local_var.future_list = []
    try:
        yield
    finally:
        try:
            torch.futures.wait_all(_thread_local_var.future_list)
        finally:
            del _thread_local_var.future_list


def rpc_sync(
    to: Any,
    func: Callable[..., Any],
    args: tuple | None = None,
    kwargs: dict | None = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> Any:
    """Run ``func(*args, **kwargs)`` on worker ``to`` and return its result.

    Arguments as ``rpc_async``; raises what the future would.

    Example::

        rrpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 3))  # tensor([4., 4.])
    """
    # Blocking at once, it waits on a SyncReply: cheaper than a torch Future,
    # and an error raised from it holds no hidden reference to the caller's frames.
    return _send_call(to, func, args, kwargs, timeout, sync=True).wait()


def _send_call(to, func, args, kwargs, timeout: float, sync: bool):
    agent = current_agent()
    if not callable(func):
        raise TypeError(f"func must be callable, not {type(func).__name__}")
    peer = agent.worker_info(to)
    what = Description((naming, "call of {}", func))
    payload = (func, args or (), kwargs or {})
    timeout = agent.resolve_timeout(timeout)
    # "sync"/"async": torch's name for the call, in its profiler's events.
    return agent.send(peer, CALL, payload, timeout, what, sync, "sync" if sync else "async")


def get_rpc_timeout() -> float:
    """The default timeout of this worker's calls, in seconds (``rpc_timeout`` of its options)."""
    return current_agent().options.rpc_timeout


def _set_rpc_timeout(rpc_timeout: float) -> None:
    """Change this worker's default call timeout (seconds), as torch's private helper."""
    current_agent().options.rpc_timeout = float(rpc_timeout)


def is_available() -> bool:
    """Whether rrpc can be used here: always True (torch's answers for its C++ build)."""
    return True


def get_worker_info(worker_name: str | None = None) -> WorkerInfo:
    """The ``WorkerInfo(name, id)`` of ``worker_name``, or of this worker when None."""
    agent = current_agent()
    return agent.info if worker_name is None else agent.worker_info(worker_name)


def stats(by: str = "peer") -> dict[str, Any]:
    """This worker's counters, by peer (the default), by function, or as a whole.

    ``by="peer"``: ``{peer name: row}``; ``by="function"``: ``{function: row}``,
    a function named ``module.qualname`` (``torch.add``, ``__main__.step``) or,
    for rrpc's own protocol messages, by their kind (``RREF_FETCH``). A row:
    of the calls this worker sent, ``calls_sent``, ``replies``, ``errors``,
    ``timeouts``, ``in_flight`` and their latency (``latency_total`` in
    seconds, ``latency_mean_us``, ``latency_p50_us``, ``latency_p99_us``); of
    the requests it served, ``calls_served`` and ``errors_served``; traffic
    both ways, ``bytes_sent``, ``bytes_received``, ``tensor_bytes_sent``,
    ``tensor_bytes_received``. ``by="worker"``: ``in_flight``,
    ``queue_depth`` (requests waiting for a worker thread), the RRef tables
    (``rref_debug_info()``) and distributed autograd's (``autograd_*``).
    Details in ``rrpc/metrics.py``.

    Example::

        rrpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1))
        rrpc.stats()["worker1"]["calls_sent"]                  # 1
        rrpc.stats("function")["torch.add"]["latency_p50_us"]  # e.g. 180.5
    """
    agent = current_agent()
    if by == "worker":
        return worker.worker_stats(agent)
    if by == "peer":
        rows = agent.metrics.peers
    elif by == "function":
        rows = agent.metrics.functions
    else:
        raise ValueError(f"stats(by={by!r}): by is 'peer', 'function' or 'worker'")
    return {name: row.as_dict() for name, row in list(rows.items())}
