"""Fine-tune a Hugging Face model with ZeRO: transformers' Trainer on zeroshard, from a DeepSpeed JSON.

    torchrun --nproc_per_node=2 examples/hf_trainer.py --config examples/hf_ds_config.json

A small GPT-2 is built from a config (nothing is downloaded: use AutoModelForCausalLM.from_pretrained
for a real one) and trained on this file's own bytes. ZeroTrainer takes the same TrainingArguments as
Trainer; the JSON's "auto" values take theirs. save_model writes an ordinary Hugging Face checkpoint,
which is then loaded back without zeroshard. Needs `pip install 'zeroshard[hf]'`.
"""
from __future__ import annotations

import argparse
import os

import torch
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, TrainingArguments

from zeroshard.hf import ZeroTrainer


def byte_blocks(seq_len: int) -> list[dict[str, torch.Tensor]]:
    data = torch.tensor(list(open(__file__, "rb").read()), dtype=torch.long)
    blocks = data[: len(data) // seq_len * seq_len].view(-1, seq_len)
    return [{"input_ids": b, "labels": b} for b in blocks]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=os.path.join(os.path.dirname(__file__), "hf_ds_config.json"))
    parser.add_argument("--out", default="out/hf_trainer")
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--bf16", action="store_true", help="train in bf16 (fp32 master weights)")
    parser.add_argument("--cpu", action="store_true", help="gloo ranks on the CPU even with a GPU")
    opts = parser.parse_args()

    # bytes for tokens: GPT-2's own special ids (50256) would lie outside this vocabulary
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_embd=opts.width, n_layer=opts.layers,
                                       n_head=4, bos_token_id=0, eos_token_id=0))
    blocks = byte_blocks(seq_len=64)
    train, evals = blocks[len(blocks) // 10:], blocks[: len(blocks) // 10]
    args = TrainingArguments(
        output_dir=opts.out, max_steps=opts.max_steps, per_device_train_batch_size=4,
        gradient_accumulation_steps=2, learning_rate=3e-3, weight_decay=0.01, warmup_steps=0.1,
        lr_scheduler_type="cosine", max_grad_norm=1.0, bf16=opts.bf16, logging_steps=10,
        eval_strategy="steps", eval_steps=max(opts.max_steps // 2, 1), save_steps=opts.max_steps,
        save_total_limit=1, report_to="none", use_cpu=opts.cpu or not torch.cuda.is_available())
    trainer = ZeroTrainer(model=model, args=args, train_dataset=train, eval_dataset=evals,
                          zero_config=opts.config)
    trainer.train()  # trainer.train(resume_from_checkpoint=True) continues at any number of ranks
    # giving the same global batch (Trainer's steps count batches)
    loss = trainer.evaluate()["eval_loss"]  # Trainer's: batch by batch over the ranks, then averaged
    trainer.save_model(os.path.join(opts.out, "model"))  # every rank takes part; rank 0 writes

    # One batch of every eval block, through the trained model (every rank: at stage 3 each forward
    # gathers the shards) and through the saved checkpoint loaded back without zeroshard.
    batch = torch.stack([b["input_ids"] for b in evals])
    trainer.model.eval()
    with torch.no_grad():
        trained = trainer.model(input_ids=batch.to(trainer.args.device), labels=batch.to(trainer.args.device))
    if trainer.is_world_process_zero():  # an ordinary checkpoint: no zeroshard needed to use it
        reloaded = AutoModelForCausalLM.from_pretrained(os.path.join(opts.out, "model")).eval()
        with torch.no_grad():
            again = reloaded(input_ids=batch, labels=batch).loss.item()
        weights = "bf16 weights; the checkpoint holds the fp32 masters" if opts.bf16 else "fp32"
        print(f"eval loss {loss:.4f} after {trainer.state.global_step} steps (Trainer.evaluate); one batch "
              f"of the eval blocks: trained {trained.loss.item():.4f}, reloaded without zeroshard "
              f"{again:.4f} ({weights})")


if __name__ == "__main__":
    main()
