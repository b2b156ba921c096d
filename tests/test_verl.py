"""verl (RL post-training on FSDP2) drives fsdp2 through its own code as it
drives torch's fully_shard.

verl 0.9.1 imports `fully_shard`, `FSDPModule` and the policies from
`torch.distributed.fsdp` at its import, so a user switches by calling
`fsdp2.install_as_torch_fsdp()` first. Each scenario runs verl's functions
twice on two gloo ranks, once over torch's fully_shard and once over fsdp2
(each in fresh ranks, since verl binds the names when imported), and the
results must be equal bit for bit: losses, gradient norms, exported weights
and the trained parameters. verl's device is the CPU through a platform plugin
of its own kind (tests/verl_cpu.py).
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist import run_ranks
from torch.distributed.tensor import DTensor

import fsdp2

STEPS = 3
MICRO_BATCHES = 2
MICRO_BATCH = 2  # sequences per rank per micro-batch
SEQ = 12
VOCAB = 96
WORLD_SIZE = 2


def _tiny_qwen_config(tie: bool) -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
        attn_implementation="eager",
    )


def _tiny_qwen(tie: bool = False, seed: int = 0) -> torch.nn.Module:
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    return Qwen2ForCausalLM(_tiny_qwen_config(tie))


def _tokens(step: int, micro: int, rank: int) -> torch.Tensor:
    """This rank's sequences of one micro-batch (the same on both runs)."""
    generator = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=generator)


def _fsdp_kwargs(mesh: Any) -> dict[str, Any]:
    """What verl's FSDPEngine passes to every fully_shard call by default
    (transformer_impl.py 464-469): bf16 compute, fp32 reduction, offload_policy
    None unless offload is configured."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=True
        ),
        "offload_policy": None,
        "reshard_after_forward": True,
    }


def _global_mean(value: torch.Tensor) -> torch.Tensor:
    value = value.detach().float().clone()
    dist.all_reduce(value)
    return value / dist.get_world_size()


def _full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
    }


def _train_step(model: torch.nn.Module, optimizer: Any, step: int, fsdp_utils: Any) -> dict:
    """One actor update as verl's dp_actor does it: each micro-batch's loss
    scaled by 1/micro-batches and reduced in its own backward, then verl's
    clipping and the optimizer."""
    rank = dist.get_rank()
    losses = []
    for micro in range(MICRO_BATCHES):
        tokens = _tokens(step, micro, rank)
        loss = model(input_ids=tokens, labels=tokens).loss / MICRO_BATCHES
        loss.backward()
        losses.append(_global_mean(loss))
    grad_norm = fsdp_utils.fsdp2_clip_grad_norm_(model.parameters(), max_norm=1.0)
    optimizer.step()
    optimizer.zero_grad()
    if isinstance(grad_norm, DTensor):  # verl returns the norm of DTensor gradients as one
        grad_norm = grad_norm.full_tensor()
    return {"losses": losses, "grad_norm": grad_norm.detach().clone()}


def _unsharded_after_forward(model: torch.nn.Module) -> list[str]:
    """Names of parameters left unsharded (plain tensors) by a forward."""
    with torch.no_grad():
        model(input_ids=_tokens(99, 0, dist.get_rank()))
    names = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    model.reshard()
    return names


def _actor(fsdp_utils: Any, mesh: Any) -> dict:
    """apply_fsdp2 with verl's defaults (bf16 compute, fp32 reduction), micro-batch
    accumulation, fsdp2_clip_grad_norm_; verl's set_reshard_after_forward
    (which reads FSDP's private state) switched off and on between steps."""
    model = _tiny_qwen()
    fsdp_utils.apply_fsdp2(model, _fsdp_kwargs(mesh), {})
    assert fsdp_utils.fsdp_version(model) == 2
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    steps, unsharded = [], []
    for step in range(STEPS):
        fsdp_utils.set_reshard_after_forward(model, step != 1)
        unsharded.append(_unsharded_after_forward(model))
        steps.append(_train_step(model, optimizer, step, fsdp_utils))
    fsdp_utils.set_reshard_after_forward(model, True)
    # The setter took effect: the layers kept their parameters unsharded after
    # the forward of step 1 only (the root never reshards after forward).
    assert len(unsharded[1]) > len(unsharded[0]) == len(unsharded[2]), unsharded
    return {"steps": steps, "unsharded": unsharded, "params": _full(model)}


def _meta_load(fsdp_utils: Any, mesh: Any) -> dict:
    """The engine's build: rank 0 makes the model on the CPU, the others on meta
    (verl's get_init_weight_context_manager), apply_fsdp2, then
    fsdp2_load_full_state_dict broadcasts rank 0's weights; then a step."""
    init_context = fsdp_utils.get_init_weight_context_manager(use_meta_tensor=True, mesh=mesh)
    with init_context():
        model = _tiny_qwen(seed=1)
    full_state = model.state_dict()
    fsdp_utils.apply_fsdp2(model, _fsdp_kwargs(mesh), {})
    fsdp_utils.fsdp2_load_full_state_dict(model, full_state, mesh, None)
    loaded = _full(model)
    reference = _tiny_qwen(seed=1)
    for name, value in reference.named_parameters():
        assert torch.equal(loaded[name], value.detach()), name
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = _train_step(model, optimizer, 0, fsdp_utils)
    return {"step": step, "params": _full(model)}


def _offload_and_export(fsdp_utils: Any, mesh: Any) -> dict:
    """Between steps the actor offloads its model and optimizer, exports its
    weights one tensor at a time to a rollout model, and loads back."""
    model = _tiny_qwen(seed=2)
    fsdp_utils.apply_fsdp2(model, _fsdp_kwargs(mesh), {})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rollout = _tiny_qwen(seed=3)  # the inference engine's own copy
    steps, generated = [], []
    for step in range(STEPS):
        steps.append(_train_step(model, optimizer, step, fsdp_utils))
        fsdp_utils.offload_fsdp2_model_to_cpu(model)
        fsdp_utils.offload_fsdp_optimizer(optimizer)
        fsdp_utils.load_fsdp2_model_to_gpu(model)
        with torch.no_grad():
            for name, value in model.state_dict().items():  # per tensor, as to vLLM
                full = value.full_tensor() if isinstance(value, DTensor) else value
                rollout.get_parameter(name).copy_(full)
        fsdp_utils.offload_fsdp2_model_to_cpu(model)
        prompt = _tokens(50 + step, 0, 0)[:1, :4]
        generated.append(rollout.generate(prompt, max_new_tokens=6, do_sample=False))
        fsdp_utils.load_fsdp2_model_to_gpu(model)
        fsdp_utils.load_fsdp_optimizer(optimizer, "cpu")
    exported = {n: p.detach().clone() for n, p in rollout.named_parameters()}
    params = _full(model)
    for name, value in params.items():
        assert torch.equal(exported[name], value), name
    return {"steps": steps, "generated": generated, "params": params}


def _lora_model(tie: bool, mesh: Any, fsdp_utils: Any) -> Any:
    from peft import LoraConfig, get_peft_model

    model = _tiny_qwen(tie=tie, seed=4)
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)
    model = get_peft_model(model, config)
    # verl's engine wraps the layers by class, the peft model at the root.
    fsdp_utils.apply_fsdp2(
        model,
        _fsdp_kwargs(mesh),
        {"wrap_policy": {"transformer_layer_cls_to_wrap": ["Qwen2DecoderLayer"]}},
    )
    return model


def _lora(fsdp_utils: Any, mesh: Any) -> dict:
    """LoRA actors: the adapters trained, then synced to the rollout three ways
    (all at once, layer by layer, and merged into the base weights in bf16 with
    tied embeddings)."""
    results: dict[str, Any] = {}
    model = _lora_model(tie=False, mesh=mesh, fsdp_utils=fsdp_utils)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    results["steps"] = [_train_step(model, optimizer, step, fsdp_utils) for step in range(STEPS)]
    adapters = fsdp_utils.collect_lora_params(model, layered_summon=False, base_sync_done=True)
    layered = fsdp_utils.collect_lora_params(model, layered_summon=True, base_sync_done=True)
    assert adapters and adapters.keys() == layered.keys()
    for name in adapters:
        assert torch.equal(adapters[name], layered[name]), name
    results["adapters"] = dict(adapters)

    tied = _lora_model(tie=True, mesh=mesh, fsdp_utils=fsdp_utils)
    tied.to(torch.bfloat16)
    tied_optimizer = torch.optim.AdamW([p for p in tied.parameters() if p.requires_grad], lr=1e-2)
    results["tied_steps"] = [
        _train_step(tied, tied_optimizer, step, fsdp_utils) for step in range(STEPS)
    ]
    before = _full(tied)
    merged = fsdp_utils.collect_merged_lora_params(tied)
    assert (
        "model.embed_tokens.weight" in merged
        and merged["model.embed_tokens.weight"].dtype == torch.bfloat16
    )
    after = _full(tied)
    for name, value in before.items():  # merging restored the base weights
        assert torch.equal(after[name], value), name
    results["merged"] = dict(merged)
    return results


SCENARIOS: dict[str, Callable[[Any, Any], dict]] = {
    "actor": _actor,
    "meta_load": _meta_load,
    "offload_and_export": _offload_and_export,
    "lora": _lora,
}


def _verl_under(implementation: str) -> None:
    """In a fresh rank, before verl is imported: fsdp2 under torch's names (for
    "fsdp2"; verl binds them at its import), and the CPU as verl's device."""
    if implementation == "fsdp2":
        fsdp2.install_as_torch_fsdp()
    import verl_cpu

    verl_cpu.use()


def _verl_utilities(rank: int, world_size: int, implementation: str, out_dir: Path) -> None:
    _verl_under(implementation)
    from torch.distributed.device_mesh import init_device_mesh
    from verl.utils import fsdp_utils

    assert (fsdp_utils.fully_shard is fsdp2.fully_shard) == (implementation == "fsdp2")
    mesh = init_device_mesh("cpu", (world_size,))
    results = {name: scenario(fsdp_utils, mesh) for name, scenario in SCENARIOS.items()}
    gc.collect()
    if rank == 0:
        torch.save(results, out_dir / f"{implementation}.pt")


def _assert_equal(ours: Any, theirs: Any, where: str) -> None:
    if isinstance(theirs, dict):
        assert isinstance(ours, dict) and ours.keys() == theirs.keys(), where
        for key in theirs:
            _assert_equal(ours[key], theirs[key], f"{where}.{key}")
    elif isinstance(theirs, (list, tuple)):
        assert len(ours) == len(theirs), where
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            _assert_equal(a, b, f"{where}[{i}]")
    elif isinstance(theirs, torch.Tensor):
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs), where
    else:
        assert ours == theirs, where


@pytest.mark.distributed
def test_verl_fsdp2_utilities_train_as_under_torch(tmp_path: Path) -> None:
    """verl's apply_fsdp2 with its default actor's arguments (offload_policy=None),
    micro-batch accumulation and fsdp2_clip_grad_norm_, its set_reshard_after_forward,
    meta-device build with fsdp2_load_full_state_dict, model and optimizer offload
    with a per-tensor export to a rollout model, and LoRA adapters synced whole,
    layer by layer and merged: under fsdp2 exactly as under torch's fully_shard."""
    for implementation in ("torch", "fsdp2"):
        run_ranks(_verl_utilities, WORLD_SIZE, tmp_path / implementation, implementation, tmp_path)
    ours = torch.load(tmp_path / "fsdp2.pt")
    theirs = torch.load(tmp_path / "torch.pt")
    _assert_equal(ours, theirs, "results")


# -- verl's engine: GRPO iterations through FSDPEngineWithLMHead ---------------

PROMPTS = 4  # per rank
PROMPT_LEN = 4
RESPONSE_LEN = 6
ROLLOUT_N = 2  # responses per prompt (GRPO's group)


def _engine_worker(model_dir: Path, offload: bool = False, lora: bool = False) -> Any:
    """verl's TrainingWorker over FSDPEngineWithLMHead with the FSDP2 strategy,
    as its actor is configured by default (bf16 compute, fp32 reduction), with
    the model and optimizer offloaded between phases or with merged LoRA if asked."""
    from functools import partial

    from torch.distributed import fsdp as torch_fsdp
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import (
        FSDPActorConfig,
        FSDPEngineConfig,
        FSDPOptimizerConfig,
        HFModelConfig,
    )
    from verl.workers.engine_workers import TrainingWorker, TrainingWorkerConfig
    from verl.workers.utils.losses import ppo_loss

    lora_kwargs: dict[str, Any] = (
        {"lora_rank": 4, "lora_alpha": 8, "target_modules": "all-linear", "lora": {"merge": True}}
        if lora
        else {}
    )
    model_config = HFModelConfig(
        path=str(model_dir),
        load_tokenizer=False,
        use_remove_padding=False,
        override_config={"attn_implementation": "eager"},
        **lora_kwargs,
    )
    engine_config = FSDPEngineConfig(
        strategy="fsdp2",
        forward_only=False,
        use_dynamic_bsz=False,
        micro_batch_size_per_gpu=2,
        infer_micro_batch_size_per_gpu=2,
        use_torch_compile=False,
        param_offload=offload,
        optimizer_offload=offload,
    )
    config = TrainingWorkerConfig(
        model_type="language_model",
        model_config=model_config,
        engine_config=engine_config,
        optimizer_config=FSDPOptimizerConfig(lr=1e-3),
        checkpoint_config=CheckpointConfig(),
    )
    worker = TrainingWorker(config=config)
    worker.reset()
    # Sharded by whichever fully_shard torch's names hold (fsdp2's after the install).
    assert isinstance(worker.engine.module, torch_fsdp.FSDPModule)
    assert worker.engine.is_param_offload_enabled == offload
    assert hasattr(worker.engine.module, "peft_config") == lora
    actor_config = FSDPActorConfig(
        strategy="fsdp2",
        rollout_n=ROLLOUT_N,
        ppo_mini_batch_size=PROMPTS * ROLLOUT_N // 2,
        ppo_micro_batch_size_per_gpu=2,
        use_dynamic_bsz=False,
    )
    worker.set_loss_fn(partial(ppo_loss, config=actor_config))
    return worker


def _rollout(worker: Any, rollout: torch.nn.Module, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights synced to the rollout model one tensor at a time (the engine's
    export to vLLM/SGLang), then ROLLOUT_N sampled responses per prompt."""
    params, _ = worker.engine.get_per_tensor_param()
    with torch.no_grad():
        for name, value in params:
            rollout.get_parameter(name).copy_(value)
    generator = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    prompts = torch.randint(1, VOCAB, (PROMPTS, PROMPT_LEN), generator=generator)
    prompts = prompts.repeat_interleave(ROLLOUT_N, dim=0)
    torch.manual_seed(7 * step + dist.get_rank())
    sequences = rollout.generate(
        prompts,
        max_new_tokens=RESPONSE_LEN,
        min_new_tokens=RESPONSE_LEN,
        do_sample=True,
        top_k=0,
        pad_token_id=0,
        eos_token_id=None,
    )
    return prompts, sequences


def _grpo_batch(prompts: torch.Tensor, sequences: torch.Tensor) -> Any:
    """The rollout's batch (verl's DataProto), its rewards made GRPO advantages
    within each prompt's group."""
    import numpy as np
    from verl import DataProto
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage
    from verl.utils.model import compute_position_id_with_mask

    responses = sequences[:, PROMPT_LEN:]
    attention_mask = torch.ones_like(sequences)
    response_mask = torch.ones_like(responses)
    rewards = torch.zeros(responses.shape, dtype=torch.float32)
    rewards[:, -1] = (responses < VOCAB // 2).float().mean(dim=1)  # the outcome reward
    index = np.repeat(np.arange(PROMPTS), ROLLOUT_N)
    advantages, _ = compute_grpo_outcome_advantage(rewards, response_mask, index)
    data = DataProto.from_single_dict(
        {
            "input_ids": sequences,
            "prompts": prompts,
            "attention_mask": attention_mask,
            "position_ids": compute_position_id_with_mask(attention_mask),
            "responses": responses,
            "response_mask": response_mask,
            "advantages": advantages,
        },
        meta_info={"temperature": 1.0},
    )
    return data


def _grpo_step(worker: Any, rollout: torch.nn.Module, step: int) -> dict:
    """One GRPO iteration: rollout sync and sampling, the old policy's log-probs
    in eval, then two PPO epochs over two mini-batches."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

    prompts, sequences = _rollout(worker, rollout, step)
    data = _grpo_batch(prompts, sequences)
    # As verl's trainer computes the old policy's log-probs (ray_trainer.py,
    # _compute_old_log_prob), then updates the actor (_update_actor).
    batch = left_right_2_no_padding(data.to_tensordict())
    tu.assign_non_tensor(batch, calculate_entropy=True, compute_loss=False)
    output = worker.infer_batch(batch)
    old_log_probs = no_padding_2_padding(tu.get(output, "log_probs"), batch).float()
    data.batch["old_log_probs"] = old_log_probs
    batch = left_right_2_no_padding(data.to_tensordict())
    mini_batch = dist.get_world_size() * PROMPTS * ROLLOUT_N // 2
    tu.assign_non_tensor(
        batch,
        calculate_entropy=False,
        global_batch_size=mini_batch,
        mini_batch_size=mini_batch,
        epochs=2,
        seed=step,
        dataloader_kwargs={"shuffle": True},
        compute_loss=True,
    )
    metrics = tu.get(worker.train_mini_batch(batch), "metrics")
    return {
        "sequences": sequences,
        "old_log_probs": old_log_probs.detach().clone(),
        "loss": torch.tensor(metrics["loss"]),
        "grad_norm": torch.tensor(metrics["grad_norm"]),
    }


def _engine_default(model_dir: Path, checkpoint: Path) -> dict:
    """Two GRPO iterations, a checkpoint (verl's FSDPCheckpointManager: model,
    optimizer, scheduler), then the third iteration twice: by the engine that
    trained and by a fresh engine resumed from the checkpoint."""
    worker, rollout = _engine_worker(model_dir), _tiny_qwen(seed=6)
    steps = [_grpo_step(worker, rollout, step) for step in range(2)]
    worker.save_checkpoint(str(checkpoint), global_step=2)
    steps.append(_grpo_step(worker, rollout, 2))
    resumed = _engine_worker(model_dir)
    resumed.load_checkpoint(str(checkpoint))
    again = _grpo_step(resumed, _tiny_qwen(seed=6), 2)
    _assert_equal(again, steps[-1], "the resumed engine's iteration")
    return {"steps": steps}


def _engine_offload(model_dir: Path, checkpoint: Path) -> dict:
    """The engine offloading its model and optimizer to the host between phases
    and loading them back (``engine.to``, verl's model.to / optimizer state moves)."""
    worker, rollout = _engine_worker(model_dir, offload=True), _tiny_qwen(seed=6)
    return {"steps": [_grpo_step(worker, rollout, step) for step in range(2)]}


def _engine_lora(model_dir: Path, checkpoint: Path) -> dict:
    """A LoRA actor whose rollout gets the adapters merged into the base weights."""
    worker, rollout = _engine_worker(model_dir, lora=True), _tiny_qwen(seed=6)
    return {"steps": [_grpo_step(worker, rollout, step) for step in range(2)]}


ENGINE_SCENARIOS: dict[str, Callable[[Path, Path], dict]] = {
    "default": _engine_default,
    "offload": _engine_offload,
    "lora": _engine_lora,
}


def _verl_engine(rank: int, world_size: int, implementation: str, out_dir: Path) -> None:
    import os

    _verl_under(implementation)
    # What verl's Worker reads of its launcher (the process group already exists).
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="localhost", MASTER_PORT="0"
    )
    model_dir = out_dir / "model"
    if rank == 0 and not model_dir.exists():
        _tiny_qwen(seed=5).save_pretrained(model_dir)
    dist.barrier()
    checkpoint = out_dir / implementation / "checkpoint"
    results = {name: scenario(model_dir, checkpoint) for name, scenario in ENGINE_SCENARIOS.items()}
    gc.collect()
    if rank == 0:
        torch.save(results, out_dir / f"engine_{implementation}.pt")


@pytest.mark.distributed
def test_verl_engine_grpo_trains_as_under_torch(tmp_path: Path) -> None:
    """verl's TrainingWorker and FSDPEngineWithLMHead run GRPO as its trainer
    drives them: weights exported tensor by tensor to a rollout model that
    samples a group of responses per prompt, the old policy's log-probs in eval,
    two PPO epochs over two mini-batches; with a checkpoint resumed into a fresh
    engine, with model and optimizer offload, and as a LoRA actor with merged
    export. Under fsdp2 every sampled token, log-prob, loss and gradient norm is
    torch's fully_shard's, bit for bit."""
    for implementation in ("torch", "fsdp2"):
        run_ranks(_verl_engine, WORLD_SIZE, tmp_path / implementation, implementation, tmp_path)
    ours = torch.load(tmp_path / "engine_fsdp2.pt")
    theirs = torch.load(tmp_path / "engine_torch.pt")
    _assert_equal(ours, theirs, "results")
