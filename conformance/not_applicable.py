# ruff: noqa: E501 -- one test per line, the data reads best unwrapped
"""Tests that do not apply to rrpc, each with its reason: explicit data, reviewed by hand.

Only three kinds of test are not applicable:

- TorchScript: the test scripts functions or modules (``torch.jit``);
- CUDA: the test needs GPUs, and this machine has none (whole ``Cuda*`` classes
  appear as ``Class.*``);
- torch-internal: the test reads or drives torch's own implementation objects,
  which have no rrpc counterpart and no user-facing meaning: the C++ agent and
  its debug counters (``_get_current_rpc_agent``, ``_get_debug_info``,
  ``enable_gil_profiling``), the C++ autograd context objects
  (``dist_autograd._current_context`` / ``_retrieve_context`` / ``_new_context``
  / ``_get_max_id``), torch's internal pickler and message classes, the helpers
  of torch's own shutdown protocol (``api._all_gather``, ``_wait_all_workers``,
  ...), and TensorPipe's private ``_transports`` option.

The faulty suite runs on rrpc with ``rrpc.FaultyRpcBackendOptions``, rrpc's
counterpart of torch's fault-injecting agent (``rrpc/faults.py``); its tests
are listed here only for one of the reasons above.

Everything a user could write with the public API is applicable, including
tests that use a *private* torch helper with a user-facing meaning
(``rpc._set_rpc_timeout``, ``rpc.api._wait_all``, ``_rref_context_get_debug_info``,
``dist_autograd._is_valid_context``): rrpc failing those is reported as a
missing API, not hidden here. A ``file://`` init_method, the RPC profiler
events and ``RRef`` type hints are applicable for the same reason.

The first draft was produced by scanning each test's source (and the helper
methods it calls) for the names above; every entry was then checked by hand.
Profiler tests the scan flagged only because a shared helper has a TorchScript
branch, and RemoteModule tests that ask for the plain (non-scripted) creation
mode only, were taken back out.
"""

from __future__ import annotations

NOT_APPLICABLE: dict[str, str] = {
    "CudaDdpComparisonTest.*": "CUDA: a CUDA test class, no GPU here",
    "CudaDistAutogradTest.*": "CUDA: a CUDA test class, no GPU here",
    "CudaRemoteModuleTest.*": "CUDA: a CUDA test class, no GPU here",
    "CudaRpcTest.*": "CUDA: a CUDA test class, no GPU here",
    "DistAutogradTest.test_autograd_context": "torch-internal: torch's C++ autograd context objects (dist_autograd._get_max_id, dist_autograd._retrieve_context)",
    "DistAutogradTest.test_backward_simple_script_call": "TorchScript: calls or builds @torch.jit.script functions",
    "DistAutogradTest.test_clean_context_during_backward": "torch-internal: torch's C++ autograd context objects (dist_autograd._new_context)",
    "DistAutogradTest.test_context_cleanup_nested_rpc": "torch-internal: torch's C++ autograd context objects (dist_autograd._retrieve_context)",
    "DistAutogradTest.test_context_cleanup_no_tensors": "torch-internal: torch's C++ autograd context objects (dist_autograd._retrieve_context)",
    "DistAutogradTest.test_context_cleanup_tensor_no_grad": "torch-internal: torch's C++ autograd context objects (dist_autograd._retrieve_context)",
    "DistAutogradTest.test_context_cleanup_tensor_with_grad": "torch-internal: torch's C++ autograd context objects (dist_autograd._retrieve_context)",
    "DistAutogradTest.test_debug_info": "torch-internal: reads or replaces torch's C++ RPC agent (_get_debug_info())",
    "DistAutogradTest.test_graph_for_builtin_call": "torch-internal: torch's C++ autograd context objects (dist_autograd._current_context, dist_autograd._retrieve_context)",
    "DistAutogradTest.test_graph_for_builtin_remote_call": "torch-internal: torch's C++ autograd context objects (dist_autograd._current_context, dist_autograd._retrieve_context)",
    "DistAutogradTest.test_graph_for_py_nested_call": "torch-internal: torch's C++ autograd context objects (dist_autograd._current_context, dist_autograd._retrieve_context)",
    "DistAutogradTest.test_graph_for_py_nested_call_itself": "torch-internal: torch's C++ autograd context objects (dist_autograd._current_context, dist_autograd._retrieve_context)",
    "DistAutogradTest.test_graph_for_py_nested_remote_call": "torch-internal: torch's C++ autograd context objects (dist_autograd._current_context, dist_autograd._retrieve_context)",
    "DistAutogradTest.test_graph_for_py_nested_remote_call_itself": "torch-internal: torch's C++ autograd context objects (dist_autograd._current_context, dist_autograd._retrieve_context)",
    "DistAutogradTest.test_graph_for_python_call": "torch-internal: torch's C++ autograd context objects (dist_autograd._current_context, dist_autograd._retrieve_context)",
    "DistAutogradTest.test_graph_for_python_remote_call": "torch-internal: torch's C++ autograd context objects (dist_autograd._current_context, dist_autograd._retrieve_context)",
    "DistAutogradTest.test_no_graph_with_tensors_not_require_grad": "torch-internal: torch's C++ autograd context objects (dist_autograd._current_context, dist_autograd._retrieve_context)",
    "DistAutogradTest.test_no_graph_with_tensors_not_require_grad_remote": "torch-internal: torch's C++ autograd context objects (dist_autograd._current_context, dist_autograd._retrieve_context)",
    "DistAutogradTest.test_remote_complex_args": "torch-internal: torch's C++ autograd context objects (dist_autograd._current_context)",
    "DistAutogradTest.test_rpc_complex_args": "torch-internal: torch's C++ autograd context objects (dist_autograd._current_context)",
    "DistAutogradTest.test_trainer_ps_torchscript_functions": "TorchScript: calls or builds @torch.jit.script functions",
    "DistAutogradTest.test_worker_ids_recorded": "torch-internal: torch's C++ autograd context objects (dist_autograd._current_context)",
    "FaultyAgentDistAutogradTest.test_context_cleanup_tensor_with_grad": "torch-internal: torch's C++ autograd context objects (dist_autograd._retrieve_context)",
    "FaultyAgentRpcTest.test_remote_message_dropped_pickle": "torch-internal: calls RRef._serialize(), the pickling hook of torch's C++ RRef",
    "FaultyAgentRpcTest.test_remote_message_dropped_pickle_to_self": "torch-internal: calls RRef._serialize(), the pickling hook of torch's C++ RRef",
    "FaultyAgentRpcTest.test_remote_message_script_delay_timeout": "TorchScript: calls or builds @torch.jit.script functions",
    "FaultyAgentRpcTest.test_remote_message_script_delay_timeout_to_self": "TorchScript: calls or builds @torch.jit.script functions",
    "FaultyAgentRpcTest.test_rpc_script_timeout": "TorchScript: calls or builds @torch.jit.script functions",
    "RemoteModuleTest.test_forward_async": "TorchScript: iterates every creation mode, the second a scripted RemoteModule (torch.jit.script)",
    "RemoteModuleTest.test_forward_async_script": "TorchScript: a scripted RemoteModule (module interface + torch.jit.script)",
    "RemoteModuleTest.test_forward_sync": "TorchScript: iterates every creation mode, the second a scripted RemoteModule (torch.jit.script)",
    "RemoteModuleTest.test_forward_sync_script": "TorchScript: a scripted RemoteModule (module interface + torch.jit.script)",
    "RemoteModuleTest.test_remote_module_py_pickle_not_supported_script": "TorchScript: a scripted RemoteModule (module interface + torch.jit.script)",
    "RpcTest.test_all_gather": "torch-internal: reads or replaces torch's C++ RPC agent (_get_current_rpc_agent)",
    "RpcTest.test_all_gather_timeout": "torch-internal: torch's Python-level agent protocol helpers (_all_gather)",
    "RpcTest.test_async_record_function_cbs_jit_call": "TorchScript: calls or builds @torch.jit.script functions",
    "RpcTest.test_debug_info": "torch-internal: reads or replaces torch's C++ RPC agent (_get_current_rpc_agent, _get_debug_info(), get_debug_info())",
    "RpcTest.test_disable_gil_profiling": "torch-internal: reads or replaces torch's C++ RPC agent (_get_current_rpc_agent, enable_gil_profiling, get_debug_info())",
    "RpcTest.test_duplicate_name": "torch-internal: reads or replaces torch's C++ RPC agent (_init_rpc_backend)",
    "RpcTest.test_get_worker_infos": "torch-internal: reads or replaces torch's C++ RPC agent (_get_current_rpc_agent)",
    "RpcTest.test_ignore_rref_leak": "torch-internal: torch's Python-level agent protocol helpers (_delete_all_user_and_unforked_owner_rrefs)",
    "RpcTest.test_profiler_with_script_async_rpc": "TorchScript: calls or builds @torch.jit.script functions",
    "RpcTest.test_profiler_with_script_async_rpc_single_threaded": "TorchScript: calls or builds @torch.jit.script functions",
    "RpcTest.test_profiler_with_script_remote_rpc": "TorchScript: calls or builds @torch.jit.script functions",
    "RpcTest.test_profiler_with_script_remote_rpc_single_threaded": "TorchScript: calls or builds @torch.jit.script functions",
    "RpcTest.test_profiler_with_script_sync_rpc": "TorchScript: calls or builds @torch.jit.script functions",
    "RpcTest.test_profiler_with_script_sync_rpc_single_threaded": "TorchScript: calls or builds @torch.jit.script functions",
    "RpcTest.test_py_nested_pickle": "torch-internal: torch's RPC pickler / message classes (_internal_rpc_pickler, PythonUDF)",
    "RpcTest.test_register_rpc_backend_and_set_and_start_rpc_backend": "torch-internal: reads or replaces torch's C++ RPC agent (_init_rpc_backend, register_backend)",
    "RpcTest.test_rpc_barrier_all": "torch-internal: reads or replaces torch's C++ RPC agent (_get_current_rpc_agent)",
    "RpcTest.test_rpc_barrier_multithreaded": "torch-internal: reads or replaces torch's C++ RPC agent (_get_current_rpc_agent)",
    "RpcTest.test_rpc_barrier_partial_subset": "torch-internal: reads or replaces torch's C++ RPC agent (_get_current_rpc_agent)",
    "RpcTest.test_rpc_barrier_subset": "torch-internal: reads or replaces torch's C++ RPC agent (_get_current_rpc_agent)",
    "RpcTest.test_rref_context_debug_info": "torch-internal: reads or replaces torch's C++ RPC agent (get_debug_info())",
    "RpcTest.test_rref_get_future": "TorchScript: calls or builds @torch.jit.script functions",
    "RpcTest.test_rref_leak": "torch-internal: torch's Python-level agent protocol helpers (_delete_all_user_and_unforked_owner_rrefs)",
    "RpcTest.test_shutdown_errors": "torch-internal: torch's Python-level agent protocol helpers (_all_gather, _broadcast_to_followers, _delete_all_user_and_unforked_owner_rrefs)",
    "RpcTest.test_stress_heavy_rpc_torchscript": "TorchScript: calls or builds @torch.jit.script functions",
    "RpcTest.test_use_rpc_pickler": "torch-internal: torch's RPC pickler / message classes (_default_pickler, _internal_rpc_pickler, _use_rpc_pickler)",
    "RpcTest.test_use_rref_after_shutdown": "torch-internal: torch's RPC pickler / message classes (rpc.internal.serialize)",
    "RpcTest.test_wait_all_exit_early_script_function": "TorchScript: calls or builds @torch.jit.script functions",
    "RpcTest.test_wait_all_workers_dense": "torch-internal: torch's Python-level agent protocol helpers (_wait_all_workers)",
    "RpcTest.test_wait_all_workers_timeout": "torch-internal: torch's Python-level agent protocol helpers (_all_gather, _wait_all_workers)",
    "RpcTest.test_wait_all_workers_twice_dense": "torch-internal: torch's Python-level agent protocol helpers (_wait_all_workers)",
    "TensorPipeAgentCudaRpcTest.*": "CUDA: a CUDA test class, no GPU here",
    "TensorPipeAgentDistAutogradTest.test_backward_simple_script_call_sparse": "TorchScript: calls or builds @torch.jit.script functions",
    "TensorPipeAgentDistAutogradTest.test_context_cleanup_nested_rpc_sparse": "torch-internal: torch's C++ autograd context objects (dist_autograd._retrieve_context)",
    "TensorPipeAgentDistAutogradTest.test_context_cleanup_tensor_no_grad_sparse": "torch-internal: torch's C++ autograd context objects (dist_autograd._retrieve_context)",
    "TensorPipeAgentDistAutogradTest.test_context_cleanup_tensor_with_grad_sparse": "torch-internal: torch's C++ autograd context objects (dist_autograd._retrieve_context)",
    "TensorPipeAgentDistAutogradTest.test_graph_for_builtin_call_sparse": "torch-internal: torch's C++ autograd context objects (dist_autograd._current_context, dist_autograd._retrieve_context)",
    "TensorPipeAgentDistAutogradTest.test_graph_for_builtin_remote_call_sparse": "torch-internal: torch's C++ autograd context objects (dist_autograd._current_context, dist_autograd._retrieve_context)",
    "TensorPipeAgentDistAutogradTest.test_graph_for_py_nested_call_itself_sparse": "torch-internal: torch's C++ autograd context objects (dist_autograd._current_context, dist_autograd._retrieve_context)",
    "TensorPipeAgentDistAutogradTest.test_graph_for_py_nested_call_sparse": "torch-internal: torch's C++ autograd context objects (dist_autograd._current_context, dist_autograd._retrieve_context)",
    "TensorPipeAgentDistAutogradTest.test_graph_for_py_nested_remote_call_itself_sparse": "torch-internal: torch's C++ autograd context objects (dist_autograd._current_context, dist_autograd._retrieve_context)",
    "TensorPipeAgentDistAutogradTest.test_graph_for_py_nested_remote_call_sparse": "torch-internal: torch's C++ autograd context objects (dist_autograd._current_context, dist_autograd._retrieve_context)",
    "TensorPipeAgentDistAutogradTest.test_graph_for_python_call_sparse": "torch-internal: torch's C++ autograd context objects (dist_autograd._current_context, dist_autograd._retrieve_context)",
    "TensorPipeAgentDistAutogradTest.test_graph_for_python_remote_call_sparse": "torch-internal: torch's C++ autograd context objects (dist_autograd._current_context, dist_autograd._retrieve_context)",
    "TensorPipeAgentDistAutogradTest.test_no_graph_with_tensors_not_require_grad_remote_sparse": "torch-internal: torch's C++ autograd context objects (dist_autograd._current_context, dist_autograd._retrieve_context)",
    "TensorPipeAgentDistAutogradTest.test_no_graph_with_tensors_not_require_grad_sparse": "torch-internal: torch's C++ autograd context objects (dist_autograd._current_context, dist_autograd._retrieve_context)",
    "TensorPipeAgentDistAutogradTest.test_remote_complex_args_sparse": "torch-internal: torch's C++ autograd context objects (dist_autograd._current_context)",
    "TensorPipeAgentDistAutogradTest.test_rpc_complex_args_sparse": "torch-internal: torch's C++ autograd context objects (dist_autograd._current_context)",
    "TensorPipeAgentRpcTest.test_dynamic_rpc_existing_rank_can_communicate_with_new_rank_cuda": "CUDA: needs GPUs (skip_if_lt_x_gpu), none here",
    "TensorPipeAgentRpcTest.test_infer_backend_from_options": "torch-internal: reads or replaces torch's C++ RPC agent (_get_current_rpc_agent, rpc.TensorPipeAgent)",
    "TensorPipeAgentRpcTest.test_set_and_get_num_worker_threads": "torch-internal: reads or replaces torch's C++ RPC agent (_get_current_rpc_agent, get_debug_info())",
    "TensorPipeAgentRpcTest.test_tensorpipe_set_default_timeout": "torch-internal: TensorPipe's private _transports option",
    "TensorPipeAgentRpcTest.test_wait_all_workers_sparse": "torch-internal: torch's Python-level agent protocol helpers (_wait_all_workers)",
    "TensorPipeAgentRpcTest.test_wait_all_workers_twice_sparse": "torch-internal: torch's Python-level agent protocol helpers (_wait_all_workers)",
    "TensorPipeCudaDistAutogradTest.*": "CUDA: a CUDA test class, no GPU here",
    "ThreeWorkersRemoteModuleTest.test_send_remote_module_over_the_wire_script_not_supported": "TorchScript: a scripted RemoteModule (module interface + torch.jit.script)",
}


def not_applicable_reason(test: str) -> str | None:
    """The reason ``test`` ("Class.test_name") is not applicable, or None."""
    reason = NOT_APPLICABLE.get(test)
    if reason is None:
        reason = NOT_APPLICABLE.get(test.split(".", 1)[0] + ".*")
    return reason
