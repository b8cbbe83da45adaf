"""``rrpc.nn.api``: where ``RemoteModule`` is defined (as ``torch.distributed.nn.api``)."""
