"""``rrpc.nn``: modules that live on other workers, as ``torch.distributed.nn``.

``rrpc.nn.RemoteModule`` is ``torch.distributed.nn.RemoteModule`` on rrpc:
code moves by changing its imports.
"""

from rrpc.nn.api.remote_module import RemoteModule

__all__ = ["RemoteModule"]
