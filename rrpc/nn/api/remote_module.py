"""``RemoteModule``: an ``nn.Module`` created on another worker and used from here.

As ``torch.distributed.nn.RemoteModule``.

Rules

- Built on rrpc's public API (one exception: ``codec.current_peer()`` tells
  whether a pickling is for an rrpc message, as for RRefs). ``rrpc.remote``
  creates the module on the worker that ``remote_device`` names and keeps it
  under an RRef (``module_rref``); ``forward`` and ``forward_async`` run the
  module's own ``forward`` on that RRef's owner, through the RRef's proxies,
  which name the module by id (PyTorch sends the RRef along, which costs one
  more message per call). Inside ``rrpc.autograd.context()`` the call records
  its tensors like any RPC, so a distributed backward reaches the remote
  parameters, and ``remote_parameters()`` gives RRefs to them for
  ``DistributedOptimizer``.
- Names, attributes and error messages are PyTorch's, because code and
  PyTorch's own test suite (which runs against this module) match them: the
  classes ``RemoteModule`` and ``_RemoteModule``; the attributes
  ``_REMOTE_MODULE_PICKLED_ATTRIBUTES`` lists, plus ``forward_async`` and
  ``forward`` installed on each instance; the ``ValueError`` of every
  ``nn.Module`` method that would need the module in this process ("Method
  ``to`` not supported for RemoteModule"); the errors that parse
  ``remote_device``. As in PyTorch, ``repr()`` raises too (``extra_repr`` is one
  of those methods): never format a RemoteModule into a message.
- A RemoteModule travels only inside an rrpc message (an argument or the result
  of an RPC), as its pickled attributes; its ``module_rref`` is forked to the
  receiver like any RRef. Attributes set after construction stay behind, with a
  note on stderr (as in PyTorch). Pickled anywhere else (``pickle``,
  ``torch.save``, ``copy``) it raises PyTorch's ``RuntimeError``.
- Every attribute an instance gets is named in ``_REMOTE_MODULE_PICKLED_ATTRIBUTES``
  or ``_REMOTE_MODULE_ATTRIBUTES_IGNORE_FOR_PICKLING``; construction checks it.

Where it differs from PyTorch 2.13, each on purpose:

- No TorchScript: ``_module_interface_cls`` (a scriptable RemoteModule) raises
  ``NotImplementedError``, and ``is_scriptable`` is always False.
- ``train(mode)`` passes ``mode`` on and returns this RemoteModule. PyTorch
  drops ``mode`` (``train(False)`` leaves the module training) and returns a
  copy of the whole remote module, fetched from its owner.
- ``remote_parameters()`` asks the module's owner. PyTorch asks ``on``, which
  fails for a RemoteModule that ``init_from_module_rref`` placed elsewhere.
- ``is_device_map_set`` is always False: rrpc sends tensors through CPU memory,
  so a module on a CUDA device gets its CPU inputs moved there and its outputs
  come back on the CPU, as in PyTorch without a device map.
- A ``remote_device`` that names no worker (``"cpu"``) raises a ``TypeError``
  saying so (PyTorch: a ``TypeError`` from its C++ bindings). An unknown
  worker raises what ``rrpc.get_worker_info`` raises for it.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, NoReturn, SupportsIndex

import torch
from torch import nn

from rrpc import codec, restricted
from rrpc.api import get_worker_info, rpc_async, rpc_sync
from rrpc.messages import RpcError, WorkerInfo
from rrpc.rref import RRef, remote

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["RemoteModule"]

# What a RemoteModule sends of itself, in this order (PyTorch's names).
_REMOTE_MODULE_PICKLED_ATTRIBUTES = (
    "on",
    "device",
    "is_device_map_set",
    "is_scriptable",
    "generated_methods",
    "module_rref",
)

# What it does not send: nn.Module's own state (whatever this torch version
# keeps) and the installed methods, which the receiver installs again.
_REMOTE_MODULE_ATTRIBUTES_IGNORE_FOR_PICKLING = (
    *nn.Module().__dict__,
    "forward_async",
    "forward",
)


# -- Run on the module's owner -------------------------------------------------
@restricted.allow_call  # the module class must be exposed to arrive
def _create_module(module_cls: Callable[..., Any], args: tuple, kwargs: dict, device: str) -> Any:
    module = module_cls(*args, **kwargs)
    if not isinstance(module, nn.Module):
        raise ValueError(
            "Expect `module_cls(*args, **kwargs)` returns an instance of <class nn.Module>, "
            f"but it returns an instance of {type(module)}."
        )
    module.to(device)
    return module


@restricted.allow_call
def _param_rrefs(module_rref: RRef[nn.Module], recurse: bool) -> list[RRef[nn.Parameter]]:
    return [RRef(param) for param in module_rref.local_value().parameters(recurse)]


@restricted.allow_call
def _train(module_rref: RRef[nn.Module], mode: bool) -> None:
    module_rref.local_value().train(mode)


@restricted.allow_call
def _eval(module_rref: RRef[nn.Module]) -> None:
    module_rref.local_value().eval()


@restricted.allow_call
def _forward_on_owner(module_rref: RRef[nn.Module], device: str, args: tuple, kwargs: dict) -> Any:
    """The module's ``forward`` on a CUDA device: tensor arguments go there
    first; outputs come back through CPU memory, as every tensor does."""
    target = torch.device(device)
    if target.type == "cuda":
        args = tuple(arg.to(target) if isinstance(arg, torch.Tensor) else arg for arg in args)
        kwargs = {k: v.to(target) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    return module_rref.local_value().forward(*args, **kwargs)


def _call_forward(remote_module: _RemoteModule, args: tuple, kwargs: dict, sync: bool) -> Any:
    """Run ``forward`` on the module's owner: ``rpc_sync``'s result, or with
    ``sync`` false ``rpc_async``'s Future. It goes through the RRef's proxy,
    which names the module by id."""
    rref = remote_module.module_rref
    if torch.device(remote_module.device).type == "cuda":
        call = rpc_sync if sync else rpc_async
        return call(
            rref.owner(), _forward_on_owner, args=(rref, remote_module.device, args, kwargs)
        )
    proxy = rref.rpc_sync() if sync else rref.rpc_async()
    return proxy.forward(*args, **kwargs)


# -- The methods installed on every instance -------------------------------------
class _GeneratedMethods:
    """``forward_async`` and ``forward`` (PyTorch generates them from a template).

    Each instance gets them as bound methods. Being functions of this module
    (static methods of a module-level class), they pickle by name, which a
    RemoteModule sent over RPC needs.
    """

    @staticmethod
    @restricted.allow
    def forward_async(self: _RemoteModule, *args: Any, **kwargs: Any) -> torch.futures.Future:
        """Run the remote module's ``forward(*args, **kwargs)`` on its owner;
        return a Future of the result."""
        return _call_forward(self, args, kwargs, sync=False)

    @staticmethod
    @restricted.allow
    def forward(self: _RemoteModule, *args: Any, **kwargs: Any) -> Any:
        """Run the remote module's ``forward(*args, **kwargs)`` on its owner and
        return the result."""
        return _call_forward(self, args, kwargs, sync=True)


_GENERATED_METHODS = [_GeneratedMethods.forward_async, _GeneratedMethods.forward]


# -- Helpers -------------------------------------------------------------------
def _raise_not_supported(name: str) -> NoReturn:
    raise ValueError(f"Method ``{name}`` not supported for RemoteModule")


def _raise_no_torchscript(module_interface_cls: Any) -> NoReturn:
    name = getattr(module_interface_cls, "__qualname__", repr(module_interface_cls))
    raise NotImplementedError(
        f"RemoteModule with _module_interface_cls={name}: rrpc does not support TorchScript, "
        "so a RemoteModule cannot be scripted. Leave _module_interface_cls out: forward and "
        "forward_async work without it"
    )


def _parse_remote_device(remote_device: Any) -> tuple[str | int | None, torch.device]:
    """(worker name, or rank, or None; device) of ``"<workername>/<device>"``,
    ``"rank:<rank>/<device>"``, ``"<workername>"`` (device ``cpu``), or a
    device alone. Raises what PyTorch's ``_remote_device`` raises."""
    parse_error = (
        f"Could not parse remote_device: {remote_device}. The valid format is "
        "'<workername>/<device>' or 'rank:<rank>/<device>' or '<device>'"
    )
    if isinstance(remote_device, torch.device):
        return None, remote_device
    if not isinstance(remote_device, str):
        raise TypeError(f"Invalid type for remote_device: {type(remote_device)}")
    worker: str | None
    fields = remote_device.split("/")
    if len(fields) == 2:
        worker, device = fields
    elif len(fields) == 1:
        worker, device = (None, fields[0]) if _is_device(fields[0]) else (fields[0], "cpu")
    else:
        raise ValueError(parse_error)
    if worker == "":
        raise ValueError(parse_error)
    parsed = torch.device(device)  # torch's RuntimeError for a bad device string
    if worker is None:
        return None, parsed
    parts = worker.split(":")
    if len(parts) == 1:
        return worker, parsed
    if len(parts) == 2 and parts[0] == "rank" and parts[1].isdigit():
        return int(parts[1]), parsed
    raise ValueError(parse_error)


def _is_device(text: str) -> bool:
    try:
        torch.device(text)
    except Exception:
        return False
    return True


def _worker_info(worker: str | int) -> WorkerInfo:
    # rrpc.get_worker_info also takes a rank, as the agent's does in PyTorch.
    lookup: Callable[[Any], WorkerInfo] = get_worker_info
    return lookup(worker)


def _pickling_for_rpc() -> bool:
    """Whether the pickling under way is of an rrpc message. rrpc has no
    public way to ask; this is the hook its own RRefs use."""
    return codec.current_peer() is not None


@restricted.allow
def _remote_module_receiver(*remote_module_pickled_attrs: Any) -> RemoteModule:
    """Rebuild a RemoteModule sent over RPC (its RRef is already unpickled)."""
    remote_module = object.__new__(RemoteModule)
    remote_module.__dict__.update(
        zip(_REMOTE_MODULE_PICKLED_ATTRIBUTES, remote_module_pickled_attrs, strict=True)
    )
    remote_module._install_generated_methods()
    return remote_module


def _remote_module_reducer(remote_module: _RemoteModule) -> tuple:
    for name in remote_module.__dict__:
        if (
            name not in _REMOTE_MODULE_PICKLED_ATTRIBUTES
            and name not in _REMOTE_MODULE_ATTRIBUTES_IGNORE_FOR_PICKLING
        ):
            print(
                f"The new attribute ``{name}`` of RemoteModule is ignored during RPC pickling. "
                "To pickle this attribute, please add it to ``_REMOTE_MODULE_PICKLED_ATTRIBUTES``. "
                "Otherwise, please explicitly add it to "
                "``_REMOTE_MODULE_ATTRIBUTES_IGNORE_FOR_PICKLING``.",
                file=sys.stderr,
            )
    state = remote_module.__dict__
    return _remote_module_receiver, tuple(state[name] for name in _REMOTE_MODULE_PICKLED_ATTRIBUTES)


# -- The public classes --------------------------------------------------------
class _RemoteModule(nn.Module):
    """A module created on a remote worker; ``forward`` runs there.

    ``RemoteModule`` without the experimental ``_module_interface_cls``
    (TorchScript), which rrpc does not support. See ``RemoteModule``.
    """

    on: str | int  # the worker remote_device named: its name, or its rank
    device: str  # the device there, e.g. "cpu"
    is_device_map_set: bool
    is_scriptable: bool
    generated_methods: list[Callable[..., Any]]
    module_rref: RRef[nn.Module]

    def __init__(
        self,
        remote_device: str,
        module_cls: Callable[..., nn.Module],
        args: tuple | None = None,
        kwargs: dict[str, Any] | None = None,
        _module_interface_cls: Any = None,
    ):
        super().__init__()
        self._prepare_init(remote_device)
        if _module_interface_cls is not None:
            _raise_no_torchscript(_module_interface_cls)
        args = args if args is not None else ()
        kwargs = kwargs if kwargs is not None else {}
        self.is_scriptable = False
        self.generated_methods = _GENERATED_METHODS
        # Returns at once: an error of module_cls is raised by the first use.
        self.module_rref = remote(self.on, _create_module, (module_cls, args, kwargs, self.device))
        self._install_generated_methods()
        self._check_attribute_picklability()

    def remote_parameters(self, recurse: bool = True) -> list[RRef[nn.Parameter]]:
        """RRefs to the remote module's parameters (with ``recurse``, its
        submodules' too), owned where the module lives: for
        ``rrpc.optim.DistributedOptimizer``.

        Example::

            params = remote_linear.remote_parameters()  # [RRef(weight), RRef(bias)]
            optimizer = rrpc.optim.DistributedOptimizer(torch.optim.SGD, params, lr=0.1)
        """
        owner = self.module_rref.owner()
        return rpc_sync(owner, _param_rrefs, args=(self.module_rref, recurse))

    def get_module_rref(self) -> RRef[nn.Module]:
        """The RRef to the remote module (``module_rref``).

        Example::

            rrpc.rpc_sync("worker1", count_parameters, args=(remote_linear.get_module_rref(),))
        """
        return self.module_rref

    def __getstate__(self) -> NoReturn:
        raise RuntimeError(
            "Cannot pickle RemoteModule in python pickler. "
            "RemoteModule can only be pickled when using RPC"
        )

    def __setstate__(self, state: Any) -> NoReturn:
        raise RuntimeError(
            "Cannot unpickle RemoteModule in python pickler. "
            "RemoteModule can only be unpickled when using RPC"
        )

    def __reduce_ex__(self, protocol: SupportsIndex) -> str | tuple[Any, ...]:
        if not _pickling_for_rpc():
            return super().__reduce_ex__(protocol)  # __getstate__ raises
        return _remote_module_reducer(self)

    # nn.Module methods that would need the module in this process.
    def register_buffer(
        self, name: str, tensor: torch.Tensor | None, persistent: bool = True
    ) -> NoReturn:
        _raise_not_supported("register_buffer")

    def register_parameter(self, name: str, param: nn.Parameter | None) -> NoReturn:
        _raise_not_supported("register_parameter")

    def add_module(self, name: str, module: nn.Module | None) -> NoReturn:
        _raise_not_supported("add_module")

    def apply(self, fn: Callable[[nn.Module], None]) -> NoReturn:
        _raise_not_supported("apply")

    def cuda(self, device: int | torch.device | None = None) -> NoReturn:
        _raise_not_supported("cuda")

    def ipu(self, device: int | torch.device | None = None) -> NoReturn:
        _raise_not_supported("ipu")

    def xpu(self, device: int | torch.device | None = None) -> NoReturn:
        _raise_not_supported("xpu")

    def cpu(self) -> NoReturn:
        _raise_not_supported("cpu")

    def type(self, dst_type: torch.dtype | str) -> NoReturn:
        _raise_not_supported("type")

    def float(self) -> NoReturn:
        _raise_not_supported("float")

    def double(self) -> NoReturn:
        _raise_not_supported("double")

    def half(self) -> NoReturn:
        _raise_not_supported("half")

    def bfloat16(self) -> NoReturn:
        _raise_not_supported("bfloat16")

    def to(self, *args: Any, **kwargs: Any) -> NoReturn:
        _raise_not_supported("to")

    def register_backward_hook(self, hook: Callable[..., Any]) -> NoReturn:
        _raise_not_supported("register_backward_hook")

    def register_forward_pre_hook(
        self, hook: Callable[..., Any], prepend: bool = False, with_kwargs: bool = False
    ) -> NoReturn:
        _raise_not_supported("register_forward_pre_hook")

    def register_forward_hook(  # type: ignore[override]
        self, hook: Callable[..., Any], prepend: bool = False, with_kwargs: bool = False
    ) -> NoReturn:
        _raise_not_supported("register_forward_hook")

    def state_dict(self, *args: Any, **kwargs: Any) -> NoReturn:
        _raise_not_supported("state_dict")

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> NoReturn:
        _raise_not_supported("load_state_dict")

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        raise ValueError(
            "Method ``parameters`` not supported for RemoteModule. "
            "Please use ``remote_parameters`` instead."
        )

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> NoReturn:
        _raise_not_supported("named_parameters")

    def buffers(self, recurse: bool = True) -> NoReturn:
        _raise_not_supported("buffers")

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> NoReturn:
        _raise_not_supported("named_buffers")

    def children(self) -> NoReturn:
        _raise_not_supported("children")

    def named_children(self) -> NoReturn:
        _raise_not_supported("named_children")

    def modules(self) -> NoReturn:  # type: ignore[override]
        _raise_not_supported("modules")

    def named_modules(
        self,
        memo: set[nn.Module] | None = None,
        prefix: str = "",
        remove_duplicate: bool = True,
    ) -> NoReturn:
        _raise_not_supported("named_modules")

    def train(self, mode: bool = True) -> Self:
        """Set the remote module's training mode to ``mode``; return this RemoteModule.

        (PyTorch's ignores ``mode`` and returns a copy of the remote module.)

        Example::

            remote_linear.train()  # the module on worker1 is in training mode
        """
        rpc_sync(self.module_rref.owner(), _train, args=(self.module_rref, mode))
        return self

    def eval(self) -> Self:
        """Put the remote module in evaluation mode (its ``eval()``); return this RemoteModule.

        Example::

            remote_linear.eval()  # dropout and batch norm on worker1 now evaluate
        """
        rpc_sync(self.module_rref.owner(), _eval, args=(self.module_rref,))
        return self

    def requires_grad_(self, requires_grad: bool = True) -> NoReturn:
        _raise_not_supported("requires_grad_")

    def zero_grad(self, set_to_none: bool = True) -> NoReturn:
        _raise_not_supported("zero_grad")

    def share_memory(self) -> NoReturn:
        _raise_not_supported("share_memory")

    def extra_repr(self) -> NoReturn:
        _raise_not_supported("extra_repr")

    # -- Construction ----------------------------------------------------------
    def _prepare_init(self, remote_device: str) -> None:
        """Set ``on``, ``device`` and ``is_device_map_set`` from ``remote_device``."""
        try:
            get_worker_info()
        except RpcError:
            raise AssertionError("RemoteModule only works in RPC.") from None
        worker, device = _parse_remote_device(remote_device)
        if worker is None:
            raise TypeError(
                f"remote_device {str(remote_device)!r} names a device but no worker: a "
                "RemoteModule needs '<workername>/<device>' or 'rank:<rank>/<device>'"
            )
        self.on = worker
        self.device = str(device)
        _worker_info(worker)  # an unknown worker raises here, not at the first call
        self.is_device_map_set = False  # tensors always travel through CPU memory

    def _install_generated_methods(self) -> None:
        for method in self.generated_methods:
            setattr(self, method.__name__, types.MethodType(method, self))

    def _check_attribute_picklability(self) -> None:
        """Every attribute must be declared as pickled or not (see the rules)."""
        for name in self.__dict__:
            if (
                name not in _REMOTE_MODULE_PICKLED_ATTRIBUTES
                and name not in _REMOTE_MODULE_ATTRIBUTES_IGNORE_FOR_PICKLING
            ):
                raise AttributeError(
                    f"Attribute {name} must be either in ``_REMOTE_MODULE_PICKLED_ATTRIBUTES`` or "
                    "``_REMOTE_MODULE_ATTRIBUTES_IGNORE_FOR_PICKLING``."
                )

    @staticmethod
    @restricted.allow_call
    def init_from_module_rref(
        remote_device: str,
        module_rref: RRef[nn.Module],
        _module_interface_cls: Any = None,
    ) -> RemoteModule:
        """A RemoteModule over an existing module RRef: several RemoteModules
        (on several workers) can share one remote module.

        As in PyTorch, ``forward`` runs on the RRef's owner whatever
        ``remote_device`` says; ``remote_device`` sets ``on`` and ``device``.

        Example::

            shared = rrpc.rpc_sync(
                "worker2",
                RemoteModule.init_from_module_rref,
                args=("worker2/cpu", remote_linear.get_module_rref()),
            )
        """
        remote_module = object.__new__(RemoteModule)
        remote_module._prepare_init(remote_device)
        if _module_interface_cls is not None:
            _raise_no_torchscript(_module_interface_cls)
        remote_module.is_scriptable = False
        remote_module.generated_methods = _GENERATED_METHODS
        remote_module.module_rref = module_rref
        remote_module._install_generated_methods()
        remote_module._check_attribute_picklability()
        return remote_module


class RemoteModule(_RemoteModule):
    """An ``nn.Module`` created on another worker; ``forward`` runs there.

    ``RemoteModule(remote_device, module_cls, args, kwargs)`` calls
    ``module_cls(*args, **kwargs)`` on the worker ``remote_device`` names and
    moves the module to the device it names. ``forward(...)`` and
    ``forward_async(...)`` (a Future) take the module's ``forward`` arguments and
    run it there; inside ``rrpc.autograd.context()`` a distributed backward
    reaches its parameters, which ``remote_parameters()`` returns as RRefs for
    ``rrpc.optim.DistributedOptimizer``. ``train()`` and ``eval()`` act on the
    remote module; the other ``nn.Module`` methods raise ``ValueError``. A
    RemoteModule may be passed to other workers as an RPC argument or result.
    Mirrors ``torch.distributed.nn.RemoteModule``.

    Args:
        remote_device: ``"<workername>/<device>"`` or ``"rank:<rank>/<device>"``,
            e.g. ``"worker1/cpu"``, ``"rank:1/cpu"``; ``/<device>`` may be left
            out (``"worker1"``: the CPU).
        module_cls: a class (or any callable) that returns an ``nn.Module``,
            importable by the remote worker.
        args, kwargs: its arguments.

    Example::

        remote_linear = RemoteModule("worker1/cpu", torch.nn.Linear, args=(20, 30))
        out = remote_linear.forward(torch.randn(128, 20))     # runs on worker1
        fut = remote_linear.forward_async(torch.randn(128, 20))
        out = fut.wait()
    """

    def __init__(
        self,
        remote_device: str,
        module_cls: Callable[..., nn.Module],
        args: tuple | None = None,
        kwargs: dict[str, Any] | None = None,
    ):
        super().__init__(remote_device, module_cls, args, kwargs)
