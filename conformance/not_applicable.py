# ruff: noqa: E501 -- one test per line, the data reads best unwrapped
"""Tests that do not apply to rrpc, each with its reason: explicit data, reviewed by hand.

A test is not applicable only when all of it is one of three kinds:

- TorchScript: the test scripts functions or modules (``torch.jit``);
- CUDA: the test needs GPUs, and this machine has none (whole ``Cuda*`` classes
  appear as ``Class.*``);
- torch-internal: the test reads or drives torch's own implementation objects,
  which have no rrpc counterpart and no user-facing meaning: the C++ agent's
  type and debug counters (``get_debug_info``, ``enable_gil_profiling``), the
  C++ autograd context objects (``dist_autograd._current_context`` /
  ``_retrieve_context`` / ``_new_context`` / ``_get_max_id`` and their send and
  recv functions), torch's internal pickler and message classes, the steps of
  torch's own shutdown protocol (``api._all_gather``, ``_wait_all_workers``,
  ``_barrier``, ...), and ``RRef._serialize()``.

Where only part of a test is one of these, the rest, what a user can do, runs
as a test of our own in ``conformance/parts.py`` on both frameworks; the
reason here says which part is internal and names that test. Each reason names
what in the test's body makes it so, for a reader to check against it.

Everything a user could write with the public API is applicable, including
tests that use a *private* torch helper with a user-facing meaning
(``rpc._set_rpc_timeout``, ``rpc.api._wait_all``, ``_rref_context_get_debug_info``,
``dist_autograd._is_valid_context``, ``_get_current_rpc_agent().get_worker_infos()``,
TensorPipe's ``_transports`` option): rrpc failing those is reported as a
missing API, not hidden here. A ``file://`` init_method, the RPC profiler
events and ``RRef`` type hints are applicable for the same reason.
"""

from __future__ import annotations

NOT_APPLICABLE: dict[str, str] = {
    "CudaDdpComparisonTest.*": "CUDA: a CUDA test class, no GPU here",
    "CudaDistAutogradTest.*": "CUDA: a CUDA test class, no GPU here",
    "CudaRemoteModuleTest.*": "CUDA: a CUDA test class, no GPU here",
    "CudaRpcTest.*": "CUDA: a CUDA test class, no GPU here",
    "DistAutogradTest.test_autograd_context": "torch-internal: torch's C++ context table (dist_autograd._get_max_id, _retrieve_context(id)._context_id()); its user-facing part (each context id carries the worker id; a finished context is gone) runs as DistAutogradParts.test_autograd_context",
    "DistAutogradTest.test_backward_simple_script_call": "TorchScript: calls or builds @torch.jit.script functions (every case calls my_script_add)",
    "DistAutogradTest.test_clean_context_during_backward": "torch-internal: makes its context with dist_autograd._new_context() and counts its _send_functions(); its user-facing part (backward with a context id that does not exist raises) runs as DistAutogradParts.test_clean_context_during_backward",
    "DistAutogradTest.test_context_cleanup_nested_rpc": "torch-internal: checks that every worker forgot the context in torch's C++ context table (dist_autograd._retrieve_context); runs as DistAutogradParts.test_context_cleanup_nested_rpc, seen through _is_valid_context",
    "DistAutogradTest.test_context_cleanup_no_tensors": "torch-internal: checks that every worker forgot the context in torch's C++ context table (dist_autograd._retrieve_context); runs as DistAutogradParts.test_context_cleanup_no_tensors, seen through _is_valid_context",
    "DistAutogradTest.test_context_cleanup_tensor_no_grad": "torch-internal: checks that every worker forgot the context in torch's C++ context table (dist_autograd._retrieve_context); runs as DistAutogradParts.test_context_cleanup_tensor_no_grad, seen through _is_valid_context",
    "DistAutogradTest.test_context_cleanup_tensor_with_grad": "torch-internal: checks that every worker forgot the context in torch's C++ context table (dist_autograd._retrieve_context); runs as DistAutogradParts.test_context_cleanup_tensor_with_grad, seen through _is_valid_context",
    "DistAutogradTest.test_debug_info": "torch-internal: reads dist_autograd._get_debug_info(), in the test and in its custom Function's backward; its user-facing part (a backward through every worker with a custom Function in the middle, contexts freed after) runs as DistAutogradParts.test_debug_info",
    "DistAutogradTest.test_graph_for_builtin_call": "torch-internal: asserts only on torch's C++ autograd graph of the context (_current_context()._send_functions() / _recv_functions(), _retrieve_context); its calls (torch.add, my_py_add, my_py_nested_call by rpc_sync and remote in a context) are those the DistAutogradTest.test_backward_* tests make, gradients checked",
    "DistAutogradTest.test_graph_for_builtin_remote_call": "torch-internal: asserts only on torch's C++ autograd graph of the context (_current_context()._send_functions() / _recv_functions(), _retrieve_context); its calls (torch.add, my_py_add, my_py_nested_call by rpc_sync and remote in a context) are those the DistAutogradTest.test_backward_* tests make, gradients checked",
    "DistAutogradTest.test_graph_for_py_nested_call": "torch-internal: asserts only on torch's C++ autograd graph of the context (_current_context()._send_functions() / _recv_functions(), _retrieve_context); its calls (torch.add, my_py_add, my_py_nested_call by rpc_sync and remote in a context) are those the DistAutogradTest.test_backward_* tests make, gradients checked",
    "DistAutogradTest.test_graph_for_py_nested_call_itself": "torch-internal: asserts only on torch's C++ autograd graph of the context (_current_context()._send_functions() / _recv_functions(), _retrieve_context); its calls (torch.add, my_py_add, my_py_nested_call by rpc_sync and remote in a context) are those the DistAutogradTest.test_backward_* tests make, gradients checked",
    "DistAutogradTest.test_graph_for_py_nested_remote_call": "torch-internal: asserts only on torch's C++ autograd graph of the context (_current_context()._send_functions() / _recv_functions(), _retrieve_context); its calls (torch.add, my_py_add, my_py_nested_call by rpc_sync and remote in a context) are those the DistAutogradTest.test_backward_* tests make, gradients checked",
    "DistAutogradTest.test_graph_for_py_nested_remote_call_itself": "torch-internal: asserts only on torch's C++ autograd graph of the context (_current_context()._send_functions() / _recv_functions(), _retrieve_context); its calls (torch.add, my_py_add, my_py_nested_call by rpc_sync and remote in a context) are those the DistAutogradTest.test_backward_* tests make, gradients checked",
    "DistAutogradTest.test_graph_for_python_call": "torch-internal: asserts only on torch's C++ autograd graph of the context (_current_context()._send_functions() / _recv_functions(), _retrieve_context); its calls (torch.add, my_py_add, my_py_nested_call by rpc_sync and remote in a context) are those the DistAutogradTest.test_backward_* tests make, gradients checked",
    "DistAutogradTest.test_graph_for_python_remote_call": "torch-internal: asserts only on torch's C++ autograd graph of the context (_current_context()._send_functions() / _recv_functions(), _retrieve_context); its calls (torch.add, my_py_add, my_py_nested_call by rpc_sync and remote in a context) are those the DistAutogradTest.test_backward_* tests make, gradients checked",
    "DistAutogradTest.test_no_graph_with_tensors_not_require_grad": "torch-internal: asserts only that the context's C++ graph has no send/recv functions (_current_context()._send_functions()) and that the callee has the context (_retrieve_context)",
    "DistAutogradTest.test_no_graph_with_tensors_not_require_grad_remote": "torch-internal: asserts only that the context's C++ graph has no send/recv functions (_current_context()._send_functions()) and that the callee has the context (_retrieve_context)",
    "DistAutogradTest.test_remote_complex_args": "torch-internal: after comparing the result it reads the context's send functions and known worker ids (_current_context()); the comparison runs as DistAutogradParts.test_remote_complex_args, with a backward",
    "DistAutogradTest.test_rpc_complex_args": "torch-internal: after comparing the result it reads the context's send functions and known worker ids (_current_context()); the comparison runs as DistAutogradParts.test_rpc_complex_args, with a backward",
    "DistAutogradTest.test_trainer_ps_torchscript_functions": "TorchScript: calls or builds @torch.jit.script functions (create_torchscript_tensor, my_script_ref_add; the Python version is DistAutogradTest.test_trainer_ps)",
    "DistAutogradTest.test_worker_ids_recorded": "torch-internal: asserts only on the context's known worker ids (_current_context()._known_worker_ids())",
    "FaultyAgentDistAutogradTest.test_context_cleanup_tensor_with_grad": "torch-internal: checks cleanup in torch's C++ context table (dist_autograd._retrieve_context); runs as FaultyAgentDistAutogradParts.test_context_cleanup_tensor_with_grad, seen through _is_valid_context",
    "FaultyAgentRpcTest.test_remote_message_dropped_pickle": "torch-internal: calls RRef._serialize(), the pickling hook of torch's C++ RRef; the rest (the failed RRef passed as an argument raises) runs as FaultyAgentRpcParts.test_remote_message_dropped_pickle",
    "FaultyAgentRpcTest.test_remote_message_dropped_pickle_to_self": "torch-internal: calls RRef._serialize(), the pickling hook of torch's C++ RRef; the rest (the failed RRef passed as an argument raises) runs as FaultyAgentRpcParts.test_remote_message_dropped_pickle_to_self",
    "FaultyAgentRpcTest.test_remote_message_script_delay_timeout": "TorchScript: calls or builds @torch.jit.script functions (my_script_func; the Python version is test_udf_remote_message_delay_timeout)",
    "FaultyAgentRpcTest.test_remote_message_script_delay_timeout_to_self": "TorchScript: calls or builds @torch.jit.script functions (my_script_func; the Python version is test_udf_remote_message_delay_timeout_to_self)",
    "FaultyAgentRpcTest.test_rpc_script_timeout": "TorchScript: calls or builds @torch.jit.script functions (my_script_func; the builtin version is test_rpc_builtin_timeout)",
    "RemoteModuleTest.test_forward_async": "TorchScript: iterates every creation mode, the second a scripted RemoteModule (torch.jit.script); the plain mode runs as RemoteModuleParts.test_forward_async",
    "RemoteModuleTest.test_forward_async_script": "TorchScript: a scripted RemoteModule (module interface + torch.jit.script)",
    "RemoteModuleTest.test_forward_sync": "TorchScript: iterates every creation mode, the second a scripted RemoteModule (torch.jit.script); the plain mode runs as RemoteModuleParts.test_forward_sync",
    "RemoteModuleTest.test_forward_sync_script": "TorchScript: a scripted RemoteModule (module interface + torch.jit.script)",
    "RemoteModuleTest.test_remote_module_py_pickle_not_supported_script": "TorchScript: a scripted RemoteModule (module interface + torch.jit.script)",
    "RpcTest.test_all_gather": "torch-internal: drives api._all_gather, a step of torch's shutdown protocol, and compares it with _get_current_rpc_agent().get_worker_infos()",
    "RpcTest.test_all_gather_timeout": "torch-internal: drives api._all_gather, a step of torch's shutdown protocol",
    "RpcTest.test_async_record_function_cbs_jit_call": "TorchScript: calls or builds @torch.jit.script functions (my_script_func, through torch.ops.profiler._call_end_callbacks_on_jit_fut)",
    "RpcTest.test_debug_info": "torch-internal: compares the keys of torch's debug counters (_get_debug_info(), the C++ agent's get_debug_info(), dist_autograd._get_debug_info())",
    "RpcTest.test_disable_gil_profiling": "torch-internal: rpc.enable_gil_profiling and the C++ agent's debug counters (get_debug_info())",
    "RpcTest.test_duplicate_name": "torch-internal: calls torch's _init_rpc_backend with a store from torch.distributed.rendezvous; the same through init_rpc runs as RpcParts.test_duplicate_name",
    "RpcTest.test_ignore_rref_leak": "torch-internal: mocks api._delete_all_user_and_unforked_owner_rrefs, a step of torch's shutdown, to trip its leak check (api._ignore_rref_leak)",
    "RpcTest.test_profiler_with_script_async_rpc": "TorchScript: calls or builds @torch.jit.script functions",
    "RpcTest.test_profiler_with_script_async_rpc_single_threaded": "TorchScript: calls or builds @torch.jit.script functions",
    "RpcTest.test_profiler_with_script_remote_rpc": "TorchScript: calls or builds @torch.jit.script functions",
    "RpcTest.test_profiler_with_script_remote_rpc_single_threaded": "TorchScript: calls or builds @torch.jit.script functions",
    "RpcTest.test_profiler_with_script_sync_rpc": "TorchScript: calls or builds @torch.jit.script functions",
    "RpcTest.test_profiler_with_script_sync_rpc_single_threaded": "TorchScript: calls or builds @torch.jit.script functions",
    "RpcTest.test_py_nested_pickle": "torch-internal: MyPickleClass pickles itself with torch's RPC pickler (_internal_rpc_pickler, PythonUDF)",
    "RpcTest.test_register_rpc_backend_and_set_and_start_rpc_backend": "torch-internal: backend_registry.register_backend, and mocks api._set_and_start_rpc_agent and dist_autograd._init",
    "RpcTest.test_rpc_barrier_all": "torch-internal: reads or replaces torch's C++ RPC agent (_get_current_rpc_agent)",
    "RpcTest.test_rpc_barrier_multithreaded": "torch-internal: reads or replaces torch's C++ RPC agent (_get_current_rpc_agent)",
    "RpcTest.test_rpc_barrier_partial_subset": "torch-internal: reads or replaces torch's C++ RPC agent (_get_current_rpc_agent)",
    "RpcTest.test_rpc_barrier_subset": "torch-internal: reads or replaces torch's C++ RPC agent (_get_current_rpc_agent)",
    "RpcTest.test_rref_get_future": "TorchScript: its third case remote()s my_script_func; the builtin and Python cases run as RpcParts.test_rref_get_future",
    "RpcTest.test_rref_leak": "torch-internal: mocks api._delete_all_user_and_unforked_owner_rrefs, a step of torch's shutdown, to trip its leak check (api._ignore_rref_leak)",
    "RpcTest.test_shutdown_errors": "torch-internal: makes steps of torch's shutdown protocol fail (api._broadcast_to_followers, _delete_all_user_and_unforked_owner_rrefs, _all_gather)",
    "RpcTest.test_stress_heavy_rpc_torchscript": "TorchScript: calls or builds @torch.jit.script functions (heavy_rpc_torchscript)",
    "RpcTest.test_use_rpc_pickler": "torch-internal: torch's RPC pickler (_use_rpc_pickler, api._default_pickler, _internal_rpc_pickler)",
    "RpcTest.test_use_rref_after_shutdown": "torch-internal: rpc.internal.serialize(rref), torch's RPC pickler; its to_here() after shutdown() runs as RpcParts.test_use_rref_after_shutdown",
    "RpcTest.test_wait_all_exit_early_script_function": "TorchScript: calls or builds @torch.jit.script functions (raise_func_script)",
    "RpcTest.test_wait_all_workers_dense": "torch-internal: calls api._wait_all_workers(), a step of torch's shutdown, then shutdown(graceful=False)",
    "RpcTest.test_wait_all_workers_timeout": "torch-internal: replaces api._wait_all_workers, a step of torch's shutdown, with one built on api._all_gather",
    "RpcTest.test_wait_all_workers_twice_dense": "torch-internal: calls api._wait_all_workers(), a step of torch's shutdown, twice, then shutdown(graceful=False)",
    "TensorPipeAgentCudaRpcTest.*": "CUDA: a CUDA test class, no GPU here",
    "TensorPipeAgentDistAutogradTest.test_backward_simple_script_call_sparse": "TorchScript: calls or builds @torch.jit.script functions (every case calls my_script_add)",
    "TensorPipeAgentDistAutogradTest.test_context_cleanup_nested_rpc_sparse": "torch-internal: checks that every worker forgot the context in torch's C++ context table (dist_autograd._retrieve_context); runs as DistAutogradParts.test_context_cleanup_nested_rpc_sparse, seen through _is_valid_context",
    "TensorPipeAgentDistAutogradTest.test_context_cleanup_tensor_no_grad_sparse": "torch-internal: checks that every worker forgot the context in torch's C++ context table (dist_autograd._retrieve_context); runs as DistAutogradParts.test_context_cleanup_tensor_no_grad_sparse, seen through _is_valid_context",
    "TensorPipeAgentDistAutogradTest.test_context_cleanup_tensor_with_grad_sparse": "torch-internal: checks that every worker forgot the context in torch's C++ context table (dist_autograd._retrieve_context); runs as DistAutogradParts.test_context_cleanup_tensor_with_grad_sparse, seen through _is_valid_context",
    "TensorPipeAgentDistAutogradTest.test_graph_for_builtin_call_sparse": "torch-internal: asserts only on torch's C++ autograd graph of the context (_current_context()._send_functions() / _recv_functions(), _retrieve_context); its calls (torch.add, my_py_add, my_py_nested_call by rpc_sync and remote in a context) are those the DistAutogradTest.test_backward_* tests make, gradients checked",
    "TensorPipeAgentDistAutogradTest.test_graph_for_builtin_remote_call_sparse": "torch-internal: asserts only on torch's C++ autograd graph of the context (_current_context()._send_functions() / _recv_functions(), _retrieve_context); its calls (torch.add, my_py_add, my_py_nested_call by rpc_sync and remote in a context) are those the DistAutogradTest.test_backward_* tests make, gradients checked",
    "TensorPipeAgentDistAutogradTest.test_graph_for_py_nested_call_itself_sparse": "torch-internal: asserts only on torch's C++ autograd graph of the context (_current_context()._send_functions() / _recv_functions(), _retrieve_context); its calls (torch.add, my_py_add, my_py_nested_call by rpc_sync and remote in a context) are those the DistAutogradTest.test_backward_* tests make, gradients checked",
    "TensorPipeAgentDistAutogradTest.test_graph_for_py_nested_call_sparse": "torch-internal: asserts only on torch's C++ autograd graph of the context (_current_context()._send_functions() / _recv_functions(), _retrieve_context); its calls (torch.add, my_py_add, my_py_nested_call by rpc_sync and remote in a context) are those the DistAutogradTest.test_backward_* tests make, gradients checked",
    "TensorPipeAgentDistAutogradTest.test_graph_for_py_nested_remote_call_itself_sparse": "torch-internal: asserts only on torch's C++ autograd graph of the context (_current_context()._send_functions() / _recv_functions(), _retrieve_context); its calls (torch.add, my_py_add, my_py_nested_call by rpc_sync and remote in a context) are those the DistAutogradTest.test_backward_* tests make, gradients checked",
    "TensorPipeAgentDistAutogradTest.test_graph_for_py_nested_remote_call_sparse": "torch-internal: asserts only on torch's C++ autograd graph of the context (_current_context()._send_functions() / _recv_functions(), _retrieve_context); its calls (torch.add, my_py_add, my_py_nested_call by rpc_sync and remote in a context) are those the DistAutogradTest.test_backward_* tests make, gradients checked",
    "TensorPipeAgentDistAutogradTest.test_graph_for_python_call_sparse": "torch-internal: asserts only on torch's C++ autograd graph of the context (_current_context()._send_functions() / _recv_functions(), _retrieve_context); its calls (torch.add, my_py_add, my_py_nested_call by rpc_sync and remote in a context) are those the DistAutogradTest.test_backward_* tests make, gradients checked",
    "TensorPipeAgentDistAutogradTest.test_graph_for_python_remote_call_sparse": "torch-internal: asserts only on torch's C++ autograd graph of the context (_current_context()._send_functions() / _recv_functions(), _retrieve_context); its calls (torch.add, my_py_add, my_py_nested_call by rpc_sync and remote in a context) are those the DistAutogradTest.test_backward_* tests make, gradients checked",
    "TensorPipeAgentDistAutogradTest.test_no_graph_with_tensors_not_require_grad_remote_sparse": "torch-internal: asserts only that the context's C++ graph has no send/recv functions (_current_context()._send_functions()) and that the callee has the context (_retrieve_context)",
    "TensorPipeAgentDistAutogradTest.test_no_graph_with_tensors_not_require_grad_sparse": "torch-internal: asserts only that the context's C++ graph has no send/recv functions (_current_context()._send_functions()) and that the callee has the context (_retrieve_context)",
    "TensorPipeAgentDistAutogradTest.test_remote_complex_args_sparse": "torch-internal: after comparing the result it reads the context's send functions and known worker ids (_current_context()); the comparison runs as DistAutogradParts.test_remote_complex_args_sparse, with a backward",
    "TensorPipeAgentDistAutogradTest.test_rpc_complex_args_sparse": "torch-internal: after comparing the result it reads the context's send functions and known worker ids (_current_context()); the comparison runs as DistAutogradParts.test_rpc_complex_args_sparse, with a backward",
    "TensorPipeAgentRpcTest.test_dynamic_rpc_existing_rank_can_communicate_with_new_rank_cuda": "CUDA: needs GPUs (skip_if_lt_x_gpu), none here",
    "TensorPipeAgentRpcTest.test_infer_backend_from_options": "torch-internal: asserts the type of torch's C++ agent (rpc.TensorPipeAgent); init_rpc without a backend, then a call, runs as RpcParts.test_infer_backend_from_options",
    "TensorPipeAgentRpcTest.test_set_and_get_num_worker_threads": "torch-internal: reads the C++ agent's debug counters (get_debug_info()['agent.thread_pool_size'])",
    "TensorPipeAgentRpcTest.test_wait_all_workers_sparse": "torch-internal: calls api._wait_all_workers(), a step of torch's shutdown, then shutdown(graceful=False)",
    "TensorPipeAgentRpcTest.test_wait_all_workers_twice_sparse": "torch-internal: calls api._wait_all_workers(), a step of torch's shutdown, twice, then shutdown(graceful=False)",
    "TensorPipeCudaDistAutogradTest.*": "CUDA: a CUDA test class, no GPU here",
    "ThreeWorkersRemoteModuleTest.test_send_remote_module_over_the_wire_script_not_supported": "TorchScript: a scripted RemoteModule (module interface + torch.jit.script)",
}


def not_applicable_reason(test: str) -> str | None:
    """The reason ``test`` ("Class.test_name") is not applicable, or None."""
    reason = NOT_APPLICABLE.get(test)
    if reason is None:
        reason = NOT_APPLICABLE.get(test.split(".", 1)[0] + ".*")
    return reason
