"""Bad meshes, unsplit models and impossible tp sizes are refused before any collective, by name; a
model Hugging Face split itself (from_pretrained(tp_plan="auto")) is accepted as it is."""
from __future__ import annotations

import pytest
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import zeroshard
from helpers.spawn import spawn
from helpers.models import assert_matches_reference, reference_run
from test_tensor_parallel import GLOBAL_BATCH, STEPS, Llama, TINY_PLAN, sgd, tiny, train


def _raises(match: str, fn) -> None:
    with pytest.raises((zeroshard.ConfigError, ValueError, TypeError), match=match):
        fn()


def _errors(rank: int, world_size: int, root: str) -> None:
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    unnamed = init_device_mesh("cpu", (1, 2))
    misnamed = init_device_mesh("cpu", (1, 2), mesh_dim_names=("data", "model"))
    split = zeroshard.tensor_parallel(tiny(), mesh["tp"], TINY_PLAN)
    _raises("dimensions named", lambda: zeroshard.initialize(split, sgd, {}, mesh=unnamed))
    _raises("dimensions named", lambda: zeroshard.initialize(split, sgd, {}, mesh=misnamed))
    _raises("both mesh= and process_group=",
            lambda: zeroshard.initialize(split, sgd, {}, mesh=mesh, process_group=dist.group.WORLD))
    _raises("no parameter of the model is split", lambda: zeroshard.initialize(tiny(), sgd, {}, mesh=mesh))
    _raises("no tp mesh was given", lambda: zeroshard.initialize(split, sgd, {}))
    _raises("named 'tp'", lambda: zeroshard.initialize(tiny(), sgd, {}, mesh=mesh["tp"]))
    _raises("'colwise_rep' is not supported",
            lambda: zeroshard.tensor_parallel(tiny(), mesh["tp"], {"blocks.*.up": "colwise_rep"}))
    _raises("matched no module", lambda: zeroshard.tensor_parallel(tiny(), mesh["tp"], {"nope.*": "colwise"}))
    _raises("carries no tensor-parallel plan", lambda: zeroshard.tensor_parallel(tiny(), mesh["tp"]))
    _raises("'0', of size 5, which tp = 2 does not divide",  # (DTensor would split it unevenly)
            lambda: zeroshard.tensor_parallel(nn.Sequential(nn.Linear(4, 5)), mesh["tp"], {"0": "colwise"}))
    with zeroshard.init():
        deferred = tiny()
    _raises("built under zeroshard.init\\(\\): splitting deferred",
            lambda: zeroshard.tensor_parallel(deferred, mesh["tp"], TINY_PLAN))
    _raises("does not divide the model's num_attention_heads = 3",
            lambda: zeroshard.tensor_parallel(Llama(heads=3).lm, mesh["tp"]))
    # A refused model is left as it was, and the ranks still agree: a real run follows.
    engine = zeroshard.initialize(split, sgd, {"zero_optimization": {"stage": 3}}, mesh=mesh)
    assert engine.comm.tp_size == 2 and engine.comm.world_size == 1
    # Split by Hugging Face itself over the world (its tp mesh is 1-D: dp 1 here).
    from transformers import LlamaForCausalLM
    if rank == 0:
        Llama().lm.save_pretrained(root)
    dist.barrier()
    lm = LlamaForCausalLM.from_pretrained(root, tp_plan="auto")
    ref_model, ref_losses = reference_run(Llama, sgd, STEPS, GLOBAL_BATCH, clip=0.5)
    engine = zeroshard.initialize(Llama(lm=lm), sgd, {"zero_optimization": {"stage": 3},
                                                      "gradient_clipping": 0.5}, mesh=mesh)
    losses = train(engine, 0, 1, range(STEPS))
    assert_matches_reference(engine, losses, ref_model, ref_losses, "HF tp_plan='auto', tp 2, stage 3")


def test_bad_input_is_refused_by_name_and_hf_split_models_are_accepted(tmp_path):
    spawn(_errors, 2, str(tmp_path))
