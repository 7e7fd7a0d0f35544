"""Train a small looped model on the checkable tasks.

An Ouro model (`--family ouro`) trains in the two stages of the Ouro paper. Stage 1 trains
everything on the expected loss over exit steps plus an entropy regulariser (KL to the
uniform exit distribution). Stage 2 freezes the backbone and trains the gate towards "exit
once one more loop no longer improves this token's loss".

A Huginn-shaped model (`--family huginn`: prelude, recurrent block, coda) trains in one
stage on the loss after a random number of recurrences per step (a Poisson log-normal
around `--recurrence`), backpropagating through the last `--backprop` of them
(training/huginn_model.py); it exits by latent convergence, with no gate to train.

    python -m vllm_rlt.training.train --out trained --device cuda
    python -m vllm_rlt.training.train --family huginn --out trained-huginn --device cuda
    python -m vllm_rlt.training.train --out /tmp/smoke --smoke          # CPU, seconds
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tqdm import tqdm

from vllm_rlt.cli_parser import CLIParser
from vllm_rlt.models.huginn_config import FIXED_SETTINGS, HuginnConfig
from vllm_rlt.models.ouro import OuroConfig
from vllm_rlt.tokenizer import Tokenizer
from vllm_rlt.tokenizer.byte_level import BYTE_OFFSET, BYTE_VOCAB_SIZE, ENDOFTEXT_ID, IM_END_ID
from vllm_rlt.training.data import CHAT_TEMPLATE, TASKS, Problem, held_out, training_set
from vllm_rlt.training.huginn_model import TrainableHuginn, sample_recurrence
from vllm_rlt.training.model import TrainableOuro, exit_distribution


def model_config(args: argparse.Namespace) -> dict:
    return {
        "architectures": ["OuroForCausalLM"],
        "model_type": "ouro",
        "vocab_size": BYTE_VOCAB_SIZE,
        "hidden_size": args.hidden,
        "intermediate_size": args.hidden * 8 // 3 // 32 * 32,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.hidden // 32,
        "num_key_value_heads": args.hidden // 32,
        "head_dim": 32,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
        "total_ut_steps": 4,
        "early_exit_threshold": 1.0,
        "bos_token_id": ENDOFTEXT_ID,
        "eos_token_id": [ENDOFTEXT_ID, IM_END_ID],
        "torch_dtype": "float32",
    }


def huginn_config(args: argparse.Namespace) -> dict:
    """A Huginn checkpoint's config.json (RavenConfig's names) for the trained shape."""
    stages = (args.prelude_layers, args.layers, args.coda_layers)
    return {
        "architectures": ["RavenForCausalLM"],
        "model_type": "huginn_raven",
        "vocab_size": BYTE_VOCAB_SIZE,
        "padded_vocab_size": BYTE_VOCAB_SIZE,
        "n_embd": args.hidden,
        "n_heads": args.hidden // 32,
        "n_layers": sum(stages),
        "n_layers_in_prelude": stages[0],
        "n_layers_in_recurrent_block": stages[1],
        "n_layers_in_coda": stages[2],
        "mean_recurrence": args.recurrence,
        "mean_backprop_depth": args.backprop,
        "intermediate_size": args.hidden * 8 // 3 // 32 * 32,
        "block_size": 256,
        "norm_eps": 1e-6,
        "rope_base": 10000.0,
        "qk_bias": True,
        "bias": False,
        "tie_embeddings": True,
        **FIXED_SETTINGS,
        "bos_token_id": ENDOFTEXT_ID,
        "eos_token_id": [ENDOFTEXT_ID, IM_END_ID],
        "torch_dtype": "float32",
    }


def encode(problem: Problem) -> tuple[list[int], int]:
    """Token ids of prompt + answer + EOS, and the index of the first answer token."""
    prompt, answer = problem
    ids = [BYTE_OFFSET + b for b in (prompt + answer).encode()] + [ENDOFTEXT_ID]
    return ids, len(prompt.encode())


class Batches:
    """The training pool encoded once into padded tensors on the device; a step draws its rows
    with a seeded CPU generator, so the sample sequence is the same on every device."""

    def __init__(self, pool: list[Problem], device: torch.device, seed: int) -> None:
        encoded = [encode(p) for p in pool]
        width = max(len(ids) for ids, _ in encoded)
        self.inputs = torch.full((len(pool), width), ENDOFTEXT_ID, dtype=torch.long)
        self.targets = torch.full_like(self.inputs, ENDOFTEXT_ID)
        self.mask = torch.zeros(len(pool), width)
        for row, (ids, start) in enumerate(encoded):
            self.inputs[row, : len(ids)] = torch.tensor(ids)
            self.targets[row, : len(ids) - 1] = torch.tensor(ids[1:])
            self.mask[row, start - 1 : len(ids) - 1] = 1.0  # answer and EOS targets
        self.inputs, self.targets, self.mask = (
            t.to(device) for t in (self.inputs, self.targets, self.mask)
        )
        self.generator = torch.Generator().manual_seed(seed)
        self.device = device

    def draw(self, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Inputs [B, S], targets [B, S] and a mask [B, S] that is 1 on answer and EOS targets."""
        if size > len(self.inputs):
            pool = len(self.inputs)
            raise ValueError(f"--batch must be at most the pool size {pool}, got {size}")
        rows = torch.randperm(len(self.inputs), generator=self.generator)[:size].to(self.device)
        return self.inputs[rows], self.targets[rows], self.mask[rows]


def per_loop_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of every loop's logits: [T, B, S]."""
    loops = logits.shape[0]
    flat = logits.reshape(-1, logits.shape[-1])
    return F.cross_entropy(flat, targets.repeat(loops, 1).reshape(-1), reduction="none").view(
        loops, *targets.shape
    )


def stage1_loss(model, inputs, targets, mask, beta: float) -> torch.Tensor:
    logits, hazards = model(inputs)
    ce = per_loop_loss(logits, targets)
    probs = exit_distribution(hazards)
    expected = (probs * ce).sum(0)
    kl = (probs * torch.log(probs.clamp_min(1e-9) * probs.shape[0])).sum(0)
    return ((expected + beta * kl) * mask).sum() / mask.sum()


def recurrence_loss(model, inputs, targets, mask, recurrence: int, backprop: int, generator):
    """Cross-entropy on the answer tokens after a drawn number of recurrences."""
    steps = sample_recurrence(recurrence, generator)
    logits = model.final_logits(inputs, steps, backprop)
    ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
    return (ce.view_as(mask) * mask).sum() / mask.sum()


def stage2_loss(model, inputs, targets, mask, k: float = 50.0, gamma: float = 0.005):
    logits, hazards = model(inputs)
    ce = per_loop_loss(logits.detach(), targets)
    improvement = ce[:-1] - ce[1:]  # what one more loop gains, per loop and token
    keep_going = torch.sigmoid(k * (improvement - gamma))
    target = 1.0 - keep_going
    bce = F.binary_cross_entropy(hazards[:-1].clamp(1e-6, 1 - 1e-6), target, reduction="none")
    return (bce.mean(0) * mask).sum() / mask.sum()


@torch.no_grad()
def exact_match(model, sample: list[Problem], device, loops: int | None = None) -> float:
    """Greedy decoding at a fixed depth (default: all loops), batched; fraction correct."""
    model.eval()
    correct = 0
    for start in range(0, len(sample), 256):
        chunk = sample[start : start + 256]
        seqs = [[BYTE_OFFSET + b for b in p.encode()] for p, _ in chunk]
        done = [False] * len(chunk)
        outs: list[list[int]] = [[] for _ in chunk]
        for _ in range(12):
            width = max(len(s) for s in seqs)
            ids = torch.tensor([s + [ENDOFTEXT_ID] * (width - len(s)) for s in seqs], device=device)
            logits, _ = model(ids)
            depth = (loops or logits.shape[0]) - 1
            last = torch.tensor([len(s) - 1 for s in seqs], device=device)
            nxt = logits[depth, torch.arange(len(seqs), device=device), last].argmax(-1).tolist()
            for i, token in enumerate(nxt):
                if not done[i]:
                    if token == ENDOFTEXT_ID:
                        done[i] = True
                    else:
                        outs[i].append(token)
                seqs[i].append(token)
        for (_, answer), out in zip(chunk, outs, strict=True):
            text = bytes(t - BYTE_OFFSET for t in out if t >= BYTE_OFFSET).decode(errors="replace")
            correct += text == answer
    model.train()
    return correct / len(sample)


def train(args: argparse.Namespace) -> dict:
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    huginn = args.family == "huginn"
    raw = huginn_config(args) if huginn else model_config(args)
    if huginn:
        model: torch.nn.Module = TrainableHuginn(HuginnConfig.from_dict(raw)).to(device)
    else:
        model = TrainableOuro(OuroConfig.from_dict(raw)).to(device)
    tasks = args.tasks
    training = {task: training_set(task, args.train_size) for task in tasks}
    evaluation = {task: held_out(task, args.eval_size, training[task]) for task in tasks}
    batches = Batches([p for task in tasks for p in training[task]], device, args.seed)
    record: dict = {"config": raw, "args": vars(args), "stages": {}}

    def run_stage(name: str, steps: int, params, loss_fn, lr: float) -> None:
        optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.01, fused=device.type == "cuda")
        begin = time.time()
        # Read back only for the bar (at most twice a second) and the log: no sync per step.
        losses: list[torch.Tensor] = []
        shown_at, shown_step = time.monotonic(), 0
        with tqdm(total=steps, desc=name, unit="step", file=sys.stderr) as bar:
            for step in range(steps):
                scale = min(1.0, (step + 1) / 100) * 0.5 * (1 + math.cos(math.pi * step / steps))
                for group in optimizer.param_groups:
                    group["lr"] = lr * scale
                loss = loss_fn(model, *batches.draw(args.batch))
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                optimizer.step()
                losses.append(loss.detach())
                if time.monotonic() - shown_at >= 0.5 or step + 1 == steps:
                    mean = torch.stack(losses[shown_step:]).mean().item()
                    bar.set_postfix(loss=f"{mean:.4f}", refresh=False)
                    shown_at, shown_step = time.monotonic(), step + 1
                bar.update()
                if args.log_every and (step + 1) % args.log_every == 0:
                    recent = torch.stack(losses[-args.log_every :]).mean().item()
                    elapsed = time.time() - begin
                    line = f"{name} step {step + 1}/{steps} loss {recent:.4f} {elapsed:.0f} s"
                    tqdm.write(line, file=sys.stdout)  # above the bar, not through it
                    sys.stdout.flush()
        record["stages"][name] = {
            "steps": steps,
            "final_loss": torch.stack(losses[-50:]).mean().item() if losses else None,
            "seconds": time.time() - begin,
        }

    if huginn:
        recurrences = torch.Generator().manual_seed(args.seed)
        run_stage(
            "stage1",
            args.steps1,
            list(model.parameters()),
            lambda m, *b: recurrence_loss(
                m, *b, args.recurrence, args.backprop, generator=recurrences
            ),
            args.lr,
        )
    else:
        run_stage(
            "stage1",
            args.steps1,
            list(model.parameters()),
            lambda m, *b: stage1_loss(m, *b, beta=args.beta),
            args.lr,
        )
        for parameter in model.parameters():
            parameter.requires_grad_(False)
        gate = list(model.model.early_exit_gate.parameters())
        for parameter in gate:
            parameter.requires_grad_(True)
        run_stage("stage2", args.steps2, gate, stage2_loss, args.lr)
    sample = {task: evaluation[task][: args.eval_size] for task in tasks}
    record["exact_match_full_depth"] = {
        task: exact_match(model, sample[task], device)
        for task in tqdm(tasks, desc="exact match", unit="task", file=sys.stderr)
    }
    save(model, raw, record, Path(args.out))
    return record


def save(model: torch.nn.Module, raw: dict, record: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    state = {
        name: tensor.detach().cpu().contiguous() for name, tensor in model.state_dict().items()
    }
    save_file(state, str(out / "model.safetensors"))
    # Greedy by default: each problem has one answer.
    (out / "generation_config.json").write_text(json.dumps({"do_sample": False}) + "\n")
    Tokenizer.byte_level(CHAT_TEMPLATE).save_pretrained(out)
    (out / "training_record.json").write_text(json.dumps(record, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = CLIParser(prog="python -m vllm_rlt.training.train", description=__doc__)
    parser.add_argument("--out", required=True, help="folder to write the model to")
    parser.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda"
    )
    parser.add_argument(
        "--family", choices=("ouro", "huginn"), default="ouro", help="the looped model's outline"
    )
    parser.add_argument("--hidden", type=int, default=192, help="hidden size")
    parser.add_argument(
        "--layers", type=int, default=3, help="layers that loop (Ouro's stack, Huginn's block)"
    )
    parser.add_argument("--prelude-layers", type=int, default=1, help="huginn: prelude layers")
    parser.add_argument("--coda-layers", type=int, default=1, help="huginn: coda layers")
    parser.add_argument(
        "--recurrence", type=int, default=8, help="huginn: mean recurrences (the full depth)"
    )
    parser.add_argument(
        "--backprop", type=int, default=4, help="huginn: recurrences a step backpropagates"
    )
    parser.add_argument("--steps1", type=int, default=5000, help="stage-1 steps (whole model)")
    parser.add_argument("--steps2", type=int, default=800, help="stage-2 steps (ouro: exit gate)")
    parser.add_argument("--batch", type=int, default=256, help="problems per step")
    parser.add_argument("--lr", type=float, default=2e-3, help="learning rate")
    parser.add_argument(
        "--beta",
        type=float,
        default=0.05,
        help="weight of the KL term to a uniform exit distribution",
    )
    parser.add_argument("--train-size", type=int, default=40000, help="training problems per task")
    parser.add_argument("--eval-size", type=int, default=200, help="held-out problems per task")
    parser.add_argument("--seed", type=int, default=0, help="training seed")
    parser.add_argument(
        "--tasks", nargs="+", choices=list(TASKS), default=list(TASKS), help="tasks to train"
    )
    parser.add_argument("--log-every", type=int, default=200, help="steps per log line; 0: quiet")
    parser.add_argument("--smoke", action="store_true", help="a few steps, small sets (CPU)")
    args = parser.parse_args(argv)
    parser.device(args.device)
    if args.smoke:
        args.steps1, args.steps2, args.batch, args.train_size, args.eval_size = 20, 5, 16, 200, 20
        args.hidden, args.layers, args.log_every = 64, 1, 0
        args.recurrence, args.backprop = min(args.recurrence, 4), min(args.backprop, 2)
    record = train(args)
    print(
        json.dumps({"exact_match_full_depth": record["exact_match_full_depth"], **record["stages"]})
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
