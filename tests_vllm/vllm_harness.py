"""Drive vLLM's real scheduler and ``OffloadingConnector`` by hand, with kvstore behind them.

:class:`Engine` plays what vLLM's engine core and its GPU workers (one, or one per
tensor-parallel rank) do each step -- ``schedule()``, hand the connector metadata to
the worker connectors, run the transfers, feed a fake sampled token back through
``update_from_output`` -- but
with no model: the "GPU" KV cache is a set of CPU tensors filled with random
numbers, so the bytes that travel through the kvstore server can be checked.

Both the synchronous ``Scheduler`` and the ``AsyncScheduler`` (which is one step
behind on outputs) are supported. The structure follows vLLM's own
``tests/v1/kv_connector/unit/offloading_connector/utils.py``.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
from vllm.v1.kv_offload.base import GPULoadStoreSpec, LoadStoreSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from kvstore.integrations.vllm import KVStoreConnector, KVStoreLoadStoreSpec, KVStoreOffloadingManager, KVStoreOffloadingWorker

EOS_TOKEN_ID = 2  # OPT's
NUM_LAYERS = 2
NUM_KV_HEADS = 2
HEAD_SIZE = 8
LAYERS = tuple(f"model.decoder.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS))

# An OPT-125m config.json: enough for ModelConfig, no weights, no tokenizer.
OPT_125M_CONFIG: dict[str, Any] = {
    "architectures": ["OPTForCausalLM"],
    "model_type": "opt",
    "hidden_size": 768,
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "ffn_dim": 3072,
    "max_position_embeddings": 2048,
    "vocab_size": 50272,
    "word_embed_proj_dim": 768,
    "torch_dtype": "float16",
    "bos_token_id": 2,
    "eos_token_id": EOS_TOKEN_ID,
    "pad_token_id": 1,
    "do_layer_norm_before": True,
    "activation_function": "relu",
    "enable_bias": True,
    "layer_norm_elementwise_affine": True,
}


def write_model_dir(path: Path) -> Path:
    """A local "model" directory holding only an OPT-125m ``config.json``."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(OPT_125M_CONFIG))
    return path


def kvstore_extra_config(addr: str, namespace: str, offloaded_block_size: int, **more: Any) -> dict[str, Any]:
    """``kv_connector_extra_config`` that selects the kvstore spec (as docs/vllm.md shows)."""
    return {
        "spec_name": "KVStoreOffloadingSpec",
        "spec_module_path": "kvstore.integrations.vllm",
        "block_size": offloaded_block_size,
        "kvstore_addr": addr,
        "kvstore_namespace": namespace,
        **more,
    }


@dataclass
class Transfer:
    """One transfer the worker ran, in request-relative GPU block indexes."""

    job_id: int
    is_store: bool
    gpu_block_ids: list[int]
    gpu_block_indexes: tuple[int, ...]
    keys: list[bytes]
    expedited: bool = False  # a load vLLM waits for within the step


@dataclass
class StepLog:
    stores: list[Transfer] = field(default_factory=list)
    loads: list[Transfer] = field(default_factory=list)

    @property
    def stored(self) -> tuple[int, ...]:
        return tuple(i for t in self.stores for i in t.gpu_block_indexes)

    @property
    def loaded(self) -> tuple[int, ...]:
        return tuple(i for t in self.loads for i in t.gpu_block_indexes)


class Engine:
    """A vLLM scheduler + a worker connector and a CPU "GPU" KV cache per rank, stepped by hand.

    Args:
        model_dir: from :func:`write_model_dir`.
        extra_config: the connector's ``kv_connector_extra_config``.
        gpu_block_size: vLLM's block size (tokens per GPU block).
        num_gpu_blocks: blocks in the fake KV cache.
        async_scheduling: ``AsyncScheduler`` instead of ``Scheduler``.
        sliding_window: tokens of a sliding-window attention group instead of full attention.
        hybrid: two groups, layer 0 full attention and layer 1 a sliding window of 8 tokens.
        load_failure_policy: with a policy (``"recompute"`` or ``"fail"``), kvstore's
            ``KVStoreConnector`` under vLLM's ``kv_load_failure_policy``; without, vLLM's
            ``OffloadingConnector``.
        tensor_parallel_size: GPU workers (ranks). Above 1, each rank has its own copy of the
            config with ``parallel_config.rank`` set (as vLLM's ``WorkerBase`` does in each worker
            process), its own worker connector and "GPU" KV cache (different random bytes), and
            gets its own copy of each step's connector metadata; their connector outputs
            are combined by vLLM's ``KVOutputAggregator``, as the executor does. ``worker``,
            ``worker_connector`` and ``kv_caches`` are rank 0's (``workers``,
            ``worker_connectors``, ``rank_kv_caches``: all ranks'); :meth:`run` returns rank 0's
            transfers (``rank_logs``: each rank's).
    """

    def __init__(self, model_dir: Path, extra_config: dict[str, Any], *, gpu_block_size: int = 4,
                 num_gpu_blocks: int = 100, async_scheduling: bool = False, sliding_window: int | None = None,
                 hybrid: bool = False, load_failure_policy: str | None = None,
                 tensor_parallel_size: int = 1) -> None:
        self.async_scheduling = async_scheduling
        self.gpu_block_size = gpu_block_size
        model_config = ModelConfig(model=str(model_dir), tokenizer=str(model_dir), skip_tokenizer_init=True,
                                   dtype="float16", max_model_len=2048, seed=0)
        self.vllm_config = VllmConfig(
            model_config=model_config,
            scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=1000, max_model_len=2048,
                                             enable_chunked_prefill=True, is_encoder_decoder=False,
                                             async_scheduling=async_scheduling),
            cache_config=CacheConfig(block_size=gpu_block_size, enable_prefix_caching=True),
            kv_transfer_config=KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                                                kv_connector_extra_config=extra_config)
            if load_failure_policy is None else
            KVTransferConfig(kv_connector="KVStoreConnector", kv_connector_module_path="kvstore.integrations.vllm",
                             kv_role="kv_both", kv_connector_extra_config=extra_config,
                             kv_load_failure_policy=load_failure_policy),  # type: ignore[arg-type]
            device_config=DeviceConfig("cpu"),
            **({"parallel_config": ParallelConfig(tensor_parallel_size=tensor_parallel_size)}
               if tensor_parallel_size > 1 else {}),
        )
        self.vllm_config.cache_config.num_gpu_blocks = num_gpu_blocks
        shape = {"block_size": gpu_block_size, "num_kv_heads": NUM_KV_HEADS, "head_size": HEAD_SIZE,
                 "dtype": torch.float16}
        full = FullAttentionSpec(**shape)
        if hybrid:
            groups = [KVCacheGroupSpec([LAYERS[0]], full),
                      KVCacheGroupSpec([LAYERS[1]], SlidingWindowSpec(**shape, sliding_window=8))]
        else:
            spec = full if sliding_window is None else SlidingWindowSpec(**shape, sliding_window=sliding_window)
            groups = [KVCacheGroupSpec(list(LAYERS), spec)]
        kv_cache_config = KVCacheConfig(num_blocks=num_gpu_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
        scheduler_cls = AsyncScheduler if async_scheduling else Scheduler
        with set_current_vllm_config(self.vllm_config):
            self.scheduler = scheduler_cls(vllm_config=self.vllm_config, kv_cache_config=kv_cache_config,
                                           log_stats=True,
                                           structured_output_manager=StructuredOutputManager(self.vllm_config),
                                           block_size=gpu_block_size)
        connector_cls = OffloadingConnector if load_failure_policy is None else KVStoreConnector
        self.worker_connectors: list[OffloadingConnector] = []
        self.rank_kv_caches: list[dict[str, torch.Tensor]] = []
        self.workers: list[KVStoreOffloadingWorker] = []
        for rank in range(tensor_parallel_size):
            if tensor_parallel_size == 1:
                worker_config = self.vllm_config
            else:  # (each worker process has its own config, rank set by vLLM's WorkerBase)
                worker_config = copy.deepcopy(self.vllm_config)
                worker_config.parallel_config.rank = rank
            with set_current_vllm_config(worker_config):
                wc = connector_cls(worker_config, KVConnectorRole.WORKER, kv_cache_config)
                # The "GPU" KV cache: [num_blocks, K/V, block_size, heads, head_size] per layer, random.
                gen = torch.Generator().manual_seed(1234 + rank)
                kv_caches = {
                    name: torch.randn(num_gpu_blocks, 2, gpu_block_size, NUM_KV_HEADS, HEAD_SIZE, generator=gen,
                                      dtype=torch.float32).to(torch.float16)
                    for name in LAYERS
                }
                wc.register_kv_caches(kv_caches)
            assert wc.connector_worker is not None
            worker = wc.connector_worker.worker
            assert isinstance(worker, KVStoreOffloadingWorker)
            self.worker_connectors.append(wc)
            self.rank_kv_caches.append(kv_caches)
            self.workers.append(worker)
        self.worker_connector = self.worker_connectors[0]
        self.kv_caches = self.rank_kv_caches[0]
        self.worker: KVStoreOffloadingWorker = self.workers[0]

        connector = self.scheduler.connector
        assert isinstance(connector, OffloadingConnector)
        assert connector.connector_scheduler is not None
        self.connector_scheduler = connector.connector_scheduler
        manager = self.connector_scheduler.manager
        assert isinstance(manager, KVStoreOffloadingManager)
        self.manager: KVStoreOffloadingManager = manager
        # (as vLLM's executor: a request's transfer is finished once every rank reported it)
        self._aggregator = None if tensor_parallel_size == 1 else \
            KVOutputAggregator.from_connector(connector, self.vllm_config.parallel_config.world_size)
        self.rank_logs = [StepLog() for _ in self.workers]
        for rank in range(tensor_parallel_size):
            self._record_transfers(rank)

        init_none_hash(sha256)
        self._block_hasher = get_request_block_hasher(gpu_block_size, sha256)
        self.requests: dict[str, Request] = {}
        self._next_id = 0
        self._gpu_block_index: dict[int, int] = {}  # GPU block id -> its index in its request
        self._pending: tuple[SchedulerOutput, ModelRunnerOutput] | None = None  # async: previous step
        self.sampled = False  # whether the last step sampled a token (not only chunks of prompts)

    # -- requests
    def new_request(self, token_ids: list[int], kv_transfer_params: dict[str, Any] | None = None) -> Request:
        sampling_params = SamplingParams(max_tokens=1000)
        sampling_params.update_from_generation_config({}, EOS_TOKEN_ID)
        req = Request(request_id=str(self._next_id), prompt_token_ids=token_ids, sampling_params=sampling_params,
                      pooling_params=None, block_hasher=self._block_hasher)
        req.kv_transfer_params = kv_transfer_params
        self._next_id += 1
        self.requests[req.request_id] = req
        self.scheduler.add_request(req)
        return req

    # -- stepping
    def run(self, decoded_tokens: list[int]) -> StepLog:
        """Step until ``decoded_tokens`` are sampled, one per step that samples (a forward pass past a prompt)
        (steps that only wait for loads sample nothing), and after an EOS until the scheduler
        holds no request; returns the transfers that ran meanwhile.
        """
        self.rank_logs[:] = [StepLog() for _ in self.workers]
        tokens = list(decoded_tokens)
        for _ in range(len(tokens) + 20):
            if not tokens:
                break
            self.step(tokens[0])
            if self.sampled:  # a forward pass ran and a request past its prompt sampled this token
                tokens.pop(0)
        else:
            raise AssertionError(f"{len(tokens)} tokens were never sampled")
        if EOS_TOKEN_ID in decoded_tokens:
            self.drain()
        return self.rank_logs[0]

    def drain(self, max_steps: int = 20) -> None:
        """Step with nothing to sample until every request and transfer has finished."""
        for _ in range(max_steps):
            if not self.scheduler.requests and not self.connector_scheduler._jobs:
                if self._pending is None:
                    return
                self.scheduler.update_from_output(*self._pending)
                self._pending = None
                continue
            self.step(None)
        raise AssertionError("the engine did not drain")

    def step(self, token_id: int | None, like_vllm: bool = False) -> SchedulerOutput:
        """One engine step: schedule, transfers, a sampled ``token_id`` for every running request
        whose prompt is computed.

        ``like_vllm``: call ``wait_for_save`` in every step and wait for no transfer, as vLLM's model
        runner does; the default waits for every transfer, so that tests see each step's outcome.
        """
        out = self.scheduler.schedule()
        self._index_gpu_blocks()
        meta = out.kv_connector_metadata
        assert isinstance(meta, OffloadingConnectorMetadata)
        # (each worker gets its own copy, as over vLLM's RPC: a worker connector pops jobs from it)
        connector_outputs = [
            self._worker_step(wc, worker, out, meta if len(self.workers) == 1 else copy.deepcopy(meta), like_vllm)
            for wc, worker in zip(self.worker_connectors, self.workers)]

        req_ids = [rid for rid in out.num_scheduled_tokens]
        # A request whose prompt is not all computed yet (a chunked prefill) samples nothing: vLLM's
        # model runner discards its token, and the scheduler would append one handed back.
        sampled = [[] if self.scheduler.requests[rid].is_prefill_chunk else [token_id if token_id is not None else 0]
                   for rid in req_ids]
        self.sampled = any(sampled)
        outputs = [ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=[list(s) for s in sampled],
            kv_connector_output=kv_output,
        ) for kv_output in connector_outputs]
        if self._aggregator is None:
            [runner_output] = outputs
        else:
            aggregated = self._aggregator.aggregate(list(outputs))
            assert aggregated is not None
            runner_output = aggregated
        if self.async_scheduling:  # outputs arrive one step late
            if self._pending is not None:
                self.scheduler.update_from_output(*self._pending)
            self._pending = (out, runner_output)
        else:
            self.scheduler.update_from_output(out, runner_output)
        return out

    def _worker_step(self, wc: OffloadingConnector, worker: KVStoreOffloadingWorker, out: SchedulerOutput,
                     meta: OffloadingConnectorMetadata, like_vllm: bool) -> KVConnectorOutput:
        """What one GPU worker's model runner does with the connector in a step; its output."""
        wc.handle_preemptions(meta)
        wc.bind_connector_metadata(meta)
        wc.start_load_kv(None)  # type: ignore[arg-type]  # the connector does not use the forward context
        if out.total_num_scheduled_tokens > 0 or like_vllm:
            wc.wait_for_save()
        if not like_vllm:
            worker.wait_all()  # deterministic: every transfer submitted so far is done
        results = wc.get_transfer_results(out.finished_req_ids)  # (as vLLM's model runner asks)
        invalid_block_ids = wc.get_block_ids_with_load_errors()
        worker_meta = wc.build_connector_worker_meta()
        wc.clear_connector_metadata()
        return KVConnectorOutput(finished_sending=results.finished_sending,
                                 finished_recving=results.finished_recving,
                                 failed_recving=results.failed_recving,
                                 invalid_block_ids=invalid_block_ids,
                                 kv_connector_worker_meta=worker_meta)

    # -- bookkeeping
    def _index_gpu_blocks(self) -> None:
        for manager in self.scheduler.kv_cache_manager.coordinator.single_type_managers:
            for blocks in manager.req_to_blocks.values():
                for index, block in enumerate(blocks):
                    if block.block_id:  # (0: a sliding window's null block, outside the window)
                        self._gpu_block_index[block.block_id] = index

    def _record_transfers(self, rank: int) -> None:
        worker = self.workers[rank]
        submit_store, submit_load = worker.submit_store, worker.submit_load

        def store(job_id: int, src: GPULoadStoreSpec, dst: LoadStoreSpec) -> bool:
            self.rank_logs[rank].stores.append(self._transfer(job_id, True, src, dst))
            return submit_store(job_id, src, dst)

        def load(job_id: int, src: LoadStoreSpec, dst: GPULoadStoreSpec, expedited: bool = False) -> bool:
            self.rank_logs[rank].loads.append(self._transfer(job_id, False, dst, src, expedited))
            return submit_load(job_id, src, dst, expedited)

        worker.submit_store = store  # type: ignore[method-assign]
        worker.submit_load = load  # type: ignore[method-assign]

    def _transfer(self, job_id: int, is_store: bool, gpu: GPULoadStoreSpec, other: LoadStoreSpec,
                  expedited: bool = False) -> Transfer:
        assert isinstance(other, KVStoreLoadStoreSpec)
        ids = [int(b) for b in gpu.block_ids]
        return Transfer(job_id, is_store, ids, tuple(self._gpu_block_index[b] for b in ids), list(other.keys),
                        expedited)

    def block_ids(self, request: Request) -> list[int]:
        """The GPU block ids a running request holds, in order."""
        manager = self.scheduler.kv_cache_manager.coordinator.single_type_managers[0]
        return [b.block_id for b in manager.req_to_blocks[request.request_id]]

    def shutdown(self) -> None:
        for wc in self.worker_connectors:
            wc.shutdown()
        assert self.scheduler.connector is not None
        self.scheduler.connector.shutdown()
