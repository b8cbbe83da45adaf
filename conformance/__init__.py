"""Conformance: PyTorch's own RPC test suites, run against rrpc and against torch.

``make conformance`` (or ``.venv/bin/python -m conformance [options]``) runs the
RPC test suites shipped inside the installed torch
(``torch/testing/_internal/distributed/``) twice per test: on torch's own
framework (TensorPipe, the control) and on rrpc. The test code is torch's,
unchanged; only the agent fixture and the names the tests import differ.

Suites (``--suite``): ``rpc`` (RpcTest, TensorPipeAgentRpcTest),
``dist_autograd`` (DistAutogradTest, TensorPipeAgentDistAutogradTest),
``dist_optimizer``, ``faulty`` (FaultyAgentRpcTest, FaultyAgentDistAutogradTest),
``remote_module`` (RemoteModuleTest, ThreeWorkersRemoteModuleTest),
``examples`` (parameter server, reinforcement learning) and ``ddp``
(DdpUnderDistAutogradTest, DdpComparisonTest); each suite's CUDA classes are
listed as not applicable. The TorchScript suites (``rpc/jit/``) are not run.
Each suite also runs our own ``*Parts`` classes (``parts.py``): the
user-facing parts of its tests that are otherwise not applicable, written as
torch's tests are and run on both frameworks alike.

How a test runs
- torch mixes an agent fixture into each generic suite
  (``rpc_utils.generate_tests``: suite + fixture + ``MultiProcessTestCase``).
  We do the same (``zygote._build_classes``), with torch's
  ``TensorPipeRpcAgentTestFixture`` (or ``FaultyRpcAgentTestFixture``) for
  torch and ``fixtures.RrpcAgentTestFixture`` for rrpc, which gives rrpc's
  backend options and keeps TensorPipe's error regexes (drop-in code matching
  "RPC ran for more than" must keep working); for the faulty suite, torch's
  ``FaultyRpcAgentTestFixture`` with ``rrpc.FaultyRpcBackendOptions``.
- For rrpc, ``shim.install()`` first points ``torch.distributed.rpc``,
  ``torch.distributed.autograd``, ``torch.distributed.optim.DistributedOptimizer``
  and ``torch.distributed.nn.RemoteModule`` at rrpc (``sys.modules`` entries and
  attributes of torch's packages). The shim adapts names only; a torch name
  rrpc lacks becomes a placeholder that raises ``MissingAPIError`` when a test
  uses it, and the runner reports it as "missing: <name>".
- Speed: one *zygote* process per framework imports torch, rrpc, the shim and
  the test modules once, then forks each test's world (4 ranks for most
  suites) with a fresh rendezvous: a fresh file for ``self.file_name``
  (the fixtures' ``init_method`` is ``file://`` that file, torch's default;
  gloo process groups use it too) and a free loopback port for tests that
  use ``env://``. A test costs about a second instead of 15-40 s of spawning.
  The zygote holds no threads and never touches gRPC; each rank runs torch's
  ``MultiProcessTestCase.run_test`` and then exits as an interpreter does, so
  a hang at exit counts. Each world is its own process group, SIGKILLed when
  the test ends, whatever happens (see ``zygote``'s docstring).
- Verdicts follow torch's ``MultiProcessTestCase``: a rank that raises fails
  the test; a rank still running at the deadline (``timeouts.py``; 60 s by
  default) is a timeout, with every thread's stack dumped into its log
  (``conformance/out/logs/<framework>/<test>.rank<N>.log``).

Classification: pass / fail / timeout / skipped (the test skipped itself) /
error (the runner could not run it) / n/a. Not applicable is explicit data,
``not_applicable.NOT_APPLICABLE`` (test -> reason), limited to tests that are
all TorchScript, CUDA or torch-internal objects; n/a tests are not run
(``--include-na`` runs them on torch). A test that does not pass on torch here
is *environment-broken*: reported, and its rrpc result not counted. A test rrpc
fails on purpose is a *known difference* (``known_differences.py``).

Exit status: 1 when rrpc failed a test (fail, timeout, error) that is neither
a known difference nor environment-broken (with ``--framework torch`` alone:
when torch failed one), else 0. At the end the runner prints the README's
table: per suite and framework, then all suites.

Options: ``--suite S`` (repeatable), ``-k PATTERN`` (substring or glob of
``Class.test``, repeatable), ``--framework rrpc|torch|both``, ``--subset`` (the
tests ``make test`` runs, ``subset.SUBSET``), ``--timeout S``, ``--list``,
``--out PATH``. Output: one line per test as it finishes, totals per suite and
framework, and ``conformance/out/results.json`` (per test: each framework's
outcome, duration, exit codes, tracebacks, missing APIs, log paths).
``make test`` runs the subset on rrpc (``tests/test_conformance.py``).
"""
