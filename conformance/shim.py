"""Make torch's RPC names resolve to rrpc, in the current process.

``install()`` runs in a worker process before any test module is imported.
Afterwards ``import torch.distributed.rpc as rpc``, ``import
torch.distributed.autograd as dist_autograd``, ``from torch.distributed.optim
import DistributedOptimizer`` and ``from torch.distributed.nn import
RemoteModule`` give rrpc's objects.

The shim only adapts names; it implements no RPC behaviour. A name rrpc has no
equivalent for resolves to a ``Missing`` placeholder, so that a test module
that imports it at the top still loads; a test that *uses* it fails with
``MissingAPIError`` naming the torch API. ``MissingAPIError`` deliberately
derives from ``Exception`` only, so a test expecting ``RuntimeError`` or
``ValueError`` does not pass by accident; each use is also appended to the file
named by ``$CONFORMANCE_MISSING_LOG`` (if set), so the runner can report a
missing API even when a test swallowed the error.

Mapped names, torch -> rrpc (everything else in these namespaces is Missing):

- ``torch.distributed.rpc``: ``init_rpc``, ``shutdown``, ``rpc_sync``,
  ``rpc_async``, ``remote``, ``RRef``, ``WorkerInfo``, ``get_worker_info``,
  ``BackendType``, ``RpcBackendOptions``, ``TensorPipeRpcBackendOptions``,
  ``functions`` (``rrpc.functions``), ``is_available``, ``get_rpc_timeout``,
  ``_set_rpc_timeout``; ``api._wait_all`` and ``api._thread_local_var``;
  ``api._delete_all_user_and_unforked_owner_rrefs`` ->
  ``rrpc.rref.delete_all_user_rrefs`` (``shutdown`` does not go through it);
  ``_get_current_rpc_agent()`` (also in ``api``) -> a view of rrpc's agent with
  ``get_worker_infos()`` and ``get_worker_info()`` only (the rest of torch's
  C++ agent is Missing);
  ``_rref_context_get_debug_info`` -> ``rrpc.rref_debug_info()`` with torch's
  key names (``num_owner_rrefs``, ``num_forks`` <- ``num_owner_forks``,
  ``num_pending_users`` <- ``num_pending_confirmations + num_pending_forks``;
  ``num_pending_futures`` <- pending children, DELETEs and ACCEPTs in flight) and
  torch's value type (``str``); ``_server_process_global_profile`` (also in
  ``server_process_global_profiler``) -> rrpc's (``rrpc/profiling.py``).
- ``torch.distributed.rpc.internal``: ``RPCExecMode`` and
  ``_build_rpc_profiling_key`` are torch's own (an enum of labels and a string
  helper; neither touches torch's agent).
- ``torch.distributed.rpc.api``: the public functions above.
- ``torch.distributed.rpc.constants``: ``DEFAULT_RPC_TIMEOUT_SEC``,
  ``UNSET_RPC_TIMEOUT``, ``DEFAULT_INIT_METHOD``, ``DEFAULT_NUM_WORKER_THREADS``
  from rrpc's option defaults.
- ``torch.distributed.rpc.backend_registry``: ``BackendType`` (with
  ``FAULTY_TENSORPIPE``).
- ``torch.distributed.rpc._testing``: ``FaultyTensorPipeRpcBackendOptions`` ->
  ``rrpc.FaultyRpcBackendOptions`` (the same switches, torch's message-type
  names; see ``rrpc/faults.py``).
- ``torch.distributed.autograd``: ``context``, ``backward``, ``get_gradients``,
  ``is_available``; ``_is_valid_context`` -> ``rrpc.autograd._is_valid_context``.
- ``torch.distributed.optim.DistributedOptimizer`` -> ``rrpc.optim.DistributedOptimizer``.
- ``torch.distributed.nn.RemoteModule`` and
  ``torch.distributed.nn.api.remote_module.{RemoteModule, _RemoteModule,
  _REMOTE_MODULE_PICKLED_ATTRIBUTES}`` -> ``rrpc.nn.api.remote_module``, when
  that module exists (Missing otherwise).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import types
from collections.abc import Iterator
from typing import Any

INSTALLED = False


class MissingAPIError(Exception):
    """A test used a torch RPC name that rrpc has no equivalent for."""


def _record(name: str) -> None:
    path = os.environ.get("CONFORMANCE_MISSING_LOG")
    if path:
        with open(path, "a") as log:
            log.write(name + "\n")


class Missing:
    """Stands for a torch name rrpc lacks: loads fine, fails on use."""

    def __init__(self, name: str, why: str = "") -> None:
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_why", why)

    def _fail(self, what: str) -> MissingAPIError:
        _record(self._name)
        why = f" ({self._why})" if self._why else ""
        return MissingAPIError(f"rrpc has no equivalent of {self._name}{why} [{what}]")

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return Missing(f"{self._name}.{attr}", self._why)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise self._fail("called")

    def __iter__(self) -> Any:
        raise self._fail("iterated")

    def __enter__(self) -> Any:
        raise self._fail("entered")

    def __exit__(self, *exc: object) -> None:
        return None

    def __bool__(self) -> bool:
        raise self._fail("truth-tested")

    def __getitem__(self, key: Any) -> Any:
        raise self._fail("indexed")

    def __eq__(self, other: object) -> bool:
        raise self._fail("compared")

    __hash__ = object.__hash__

    def __mro_entries__(self, bases: tuple) -> tuple:
        raise self._fail("subclassed")

    def __instancecheck__(self, obj: object) -> bool:
        raise self._fail("used in isinstance")

    def __repr__(self) -> str:
        return f"<Missing {self._name}>"


class ShimModule(types.ModuleType):
    """A stand-in for one torch module: the mapped names, Missing for the rest."""

    def __init__(self, name: str, names: dict[str, Any], why: str = "") -> None:
        super().__init__(name, f"rrpc conformance shim for {name}")
        self.__dict__.update(names)
        self.__path__: list[str] = []  # a package: unknown submodules fail to import
        self._shim_why = why

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return Missing(f"{self.__name__}.{attr}", self.__dict__.get("_shim_why", ""))


class _AgentView:
    """torch's ``_get_current_rpc_agent()`` as far as it has a user-facing
    meaning: the worker directory. Everything else of torch's C++ agent (debug
    counters, GIL profiling, its type) is Missing."""

    def get_worker_infos(self) -> list:
        import rrpc

        return rrpc.agent.current_agent().get_worker_infos()

    def get_worker_info(self, worker_name: str | None = None) -> Any:
        import rrpc

        return rrpc.get_worker_info(worker_name)

    def __getattr__(self, attr: str) -> Any:
        return Missing(f"torch.distributed.rpc.api._get_current_rpc_agent().{attr}")


def _get_current_rpc_agent() -> _AgentView:
    import rrpc

    rrpc.agent.current_agent()  # raises as torch's does before init_rpc
    return _AgentView()


def _rref_context_get_debug_info() -> dict[str, str]:
    import rrpc

    info = rrpc.rref_debug_info()
    return {
        "num_owner_rrefs": str(info["num_owner_rrefs"]),
        "num_forks": str(info["num_owner_forks"]),
        "num_pending_users": str(info["num_pending_confirmations"] + info["num_pending_forks"]),
        # torch: protocol futures not yet answered; rrpc's are these messages.
        "num_pending_futures": str(
            info["num_pending_children"] + info["num_pending_deletes"] + info["num_pending_accepts"]
        ),
    }


def _remote_module_names() -> dict[str, Any]:
    """rrpc's RemoteModule when ``rrpc.nn.api.remote_module`` exists, else Missing."""
    names = ("RemoteModule", "_RemoteModule", "_REMOTE_MODULE_PICKLED_ATTRIBUTES")
    try:
        module = importlib.import_module("rrpc.nn.api.remote_module")
    except ImportError as exc:
        why = f"no RemoteModule: rrpc.nn.api.remote_module does not import ({exc})"
        return {
            name: Missing(f"torch.distributed.nn.api.remote_module.{name}", why) for name in names
        }
    return {
        name: getattr(module, name)
        if hasattr(module, name)
        else Missing(f"torch.distributed.nn.api.remote_module.{name}", "not in rrpc.nn")
        for name in names
    }


@contextlib.contextmanager
def tolerant_jit_script() -> Iterator[None]:
    """While torch's test modules import: a ``@torch.jit.script`` that fails
    becomes a Missing placeholder instead of failing the whole module.

    Some modules script functions at import time whose annotations name torch's
    RRef (``RRef[torch.Tensor]``); with rrpc's RRef in its place TorchScript
    cannot compile them. TorchScript is out of scope (every test that uses
    TorchScript is not applicable), so such a function only has to fail if a
    test calls it. Restored as soon as the imports are done.
    """
    import torch

    real_script = torch.jit.script

    def script(obj: Any = None, *args: Any, **kwargs: Any) -> Any:
        try:
            return real_script(obj, *args, **kwargs)
        except Exception as exc:
            name = getattr(obj, "__qualname__", repr(obj))
            return Missing(f"torch.jit.script({name})", f"TorchScript: {type(exc).__name__}")

    torch.jit.script = script
    try:
        yield
    finally:
        torch.jit.script = real_script


def install() -> None:
    """Point torch's RPC names at rrpc in this process (idempotent)."""
    global INSTALLED
    if INSTALLED:
        return
    # torch's own modules that depend on the real RPC package load first, with it.
    import torch
    import torch.distributed.autograd
    import torch.distributed.nn
    import torch.distributed.nn.api.remote_module
    import torch.distributed.optim
    import torch.distributed.rpc

    import rrpc
    import rrpc.autograd
    import rrpc.functions
    import rrpc.optim
    from rrpc.options import DEFAULT_RPC_TIMEOUT, UNSET_RPC_TIMEOUT

    public = {
        "init_rpc": rrpc.init_rpc,
        "shutdown": rrpc.shutdown,
        "rpc_sync": rrpc.rpc_sync,
        "rpc_async": rrpc.rpc_async,
        "remote": rrpc.remote,
        "get_worker_info": rrpc.get_worker_info,
        "RRef": rrpc.RRef,
        "WorkerInfo": rrpc.WorkerInfo,
        "BackendType": rrpc.BackendType,
        "RpcBackendOptions": rrpc.RpcBackendOptions,
        "TensorPipeRpcBackendOptions": rrpc.TensorPipeRpcBackendOptions,
        "get_rpc_timeout": rrpc.get_rpc_timeout,
        "is_available": rrpc.is_available,
        "_set_rpc_timeout": rrpc.api._set_rpc_timeout,
    }
    defaults = rrpc.RpcBackendOptions()
    constants = ShimModule(
        "torch.distributed.rpc.constants",
        {
            "DEFAULT_RPC_TIMEOUT_SEC": DEFAULT_RPC_TIMEOUT,
            "UNSET_RPC_TIMEOUT": UNSET_RPC_TIMEOUT,
            "DEFAULT_INIT_METHOD": defaults.init_method,
            "DEFAULT_NUM_WORKER_THREADS": defaults.num_worker_threads,
        },
    )
    api = ShimModule(
        "torch.distributed.rpc.api",
        {
            **public,
            "_wait_all": rrpc.api._wait_all,
            "_thread_local_var": rrpc.api._thread_local_var,
            "_delete_all_user_and_unforked_owner_rrefs": rrpc.rref.delete_all_user_rrefs,
            "_get_current_rpc_agent": _get_current_rpc_agent,
        },
    )
    backend_registry = ShimModule(
        "torch.distributed.rpc.backend_registry", {"BackendType": rrpc.BackendType}
    )
    submodules = {
        "api": api,
        "constants": constants,
        "backend_registry": backend_registry,
        "functions": rrpc.functions,
    }
    # Two pure-data helpers of torch's `internal` module pass through: an enum
    # the tests use as labels, and the function that spells a profiler event's
    # name. Neither touches torch's agent.
    from torch.distributed.rpc.internal import RPCExecMode, _build_rpc_profiling_key

    submodules["internal"] = ShimModule(
        "torch.distributed.rpc.internal",
        {"RPCExecMode": RPCExecMode, "_build_rpc_profiling_key": _build_rpc_profiling_key},
    )
    for name in (
        "options",
        "rref_proxy",
        "_utils",
    ):
        submodules[name] = ShimModule(f"torch.distributed.rpc.{name}", {})
    profile = {"_server_process_global_profile": rrpc._server_process_global_profile}
    submodules["server_process_global_profiler"] = ShimModule(
        "torch.distributed.rpc.server_process_global_profiler", profile
    )
    submodules["_testing"] = ShimModule(
        "torch.distributed.rpc._testing",
        {"FaultyTensorPipeRpcBackendOptions": rrpc.FaultyRpcBackendOptions},
    )
    rpc = ShimModule(
        "torch.distributed.rpc",
        {
            **public,
            **submodules,
            **profile,
            "_rref_context_get_debug_info": _rref_context_get_debug_info,
            "_get_current_rpc_agent": _get_current_rpc_agent,
        },
    )
    autograd = ShimModule(
        "torch.distributed.autograd",
        {
            "context": rrpc.autograd.context,
            "backward": rrpc.autograd.backward,
            "get_gradients": rrpc.autograd.get_gradients,
            "is_available": rrpc.autograd.is_available,
            "_is_valid_context": rrpc.autograd._is_valid_context,
        },
    )
    remote_module_names = _remote_module_names()
    remote_module = ShimModule("torch.distributed.nn.api.remote_module", remote_module_names)

    # Drop every real torch.distributed.rpc submodule from sys.modules, so an
    # import of one not mapped above fails instead of reaching torch's.
    for name in list(sys.modules):
        if name.startswith("torch.distributed.rpc."):
            del sys.modules[name]
    sys.modules["torch.distributed.rpc"] = rpc
    for name, module in submodules.items():
        sys.modules[f"torch.distributed.rpc.{name}"] = module
    sys.modules["torch.distributed.autograd"] = autograd
    sys.modules["torch.distributed.nn.api.remote_module"] = remote_module
    # `import a.b.c as x` reads attributes down the chain: set them too.
    torch.distributed.rpc = rpc  # type: ignore[attr-defined]
    torch.distributed.autograd = autograd  # type: ignore[attr-defined]
    torch.distributed.nn.api.remote_module = remote_module  # type: ignore[attr-defined]
    torch.distributed.nn.RemoteModule = remote_module_names["RemoteModule"]  # type: ignore[attr-defined]
    torch.distributed.optim.DistributedOptimizer = rrpc.optim.DistributedOptimizer  # type: ignore[attr-defined]
    INSTALLED = True
