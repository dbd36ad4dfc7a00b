"""The run options the scripts share, declared once: tokenizer and template, device and precision, logging,
checkpointing and resume, FSDP and LoRA. Each script's `Options` inherits them and declares only its algorithm's
and its data's fields:

    @dataclass
    class Options(FrozenModelOptions, RunOptions):
        loss: Literal["dpo", "ipo"] = "dpo"   # which loss
        ...

A script whose default or help differs for one of these declares that field again (train_ppo's log_interval is
1, its --lora_r also adapts the critic); config.py reads the comments through the bases, the subclass's last.
The mixins are for options that only some scripts have: a frozen model to place (FrozenModelOptions), a model
that torch.compile can take whole (CompileOption; the scripts that sample from the policy while training
do not offer it).

A help line longer than one line continues on the comment-only lines right below it (config.py joins them).
"""
from dataclasses import dataclass
from typing import Literal

# What a --resume may change. Every other option of every script is the run's identity (nano_rlhf/run.py compares
# them all with the saved state/run.json), so an option added later is part of it unless it is named here.
CHANGEABLE = frozenset({
    # the run's course, not its math: how long, how often, where, what it reports
    "max_steps", "stop_at", "log_interval", "eval_interval", "save_interval", "report_to", "resume", "overwrite",
    "out_dir", "device", "dist_timeout",
    # batch_size x grad_accum x ranks is compared instead (the global batch: one process follows N ranks)
    "batch_size", "grad_accum",
    # the same math computed another way: speed and memory (sharding, compiling, recomputing, splitting)
    "compile", "compile_rollout", "grad_checkpoint", "fsdp", "frozen", "offload_frozen", "micro_batch_size",
    "precompute_ref", "share_prompt_prefill", "compact_rollout",
    # data files: compared by their sha256 (state/run.json's data_sha256), not by their path
    "data", "eval_data", "prompts", "eval_prompts", "ptx_data",
    # what the periodic evaluation and the warnings look at; training never reads them
    "eval_samples", "kl_warn", "score_warn", "retain_warn",
})

ChatTemplate = Literal["auto", "chatml", "smollm2", "qwen2.5", "qwen3", "llama3", "plain"]   # tokenizer.CHAT_TEMPLATES

@dataclass
class RunOptions:
    tokenizer: str = ""           # tokenizer.json; empty = the one in --init
    eos_token: str = ""           # end-of-text token name; empty = from tokenizer_config.json or the usual names
    pad_token: str = ""           # pad token name; empty = likewise (none: an id outside the vocabulary)
    chat_template: ChatTemplate = "auto"  # how conversational data is rendered;
                                          # auto = recognised from the tokenizer's own template
    date_string: str = ""         # Llama 3 "Today Date" (e.g. "26 Jul 2024"); empty = the one saved with the
                                  # tokenizer, else the template's default
    device: str = "auto"          # cpu, cuda, cuda:N, or auto
    dtype: Literal["float32", "bfloat16"] = "float32"  # bfloat16 = autocast (weights and log-softmax stay float32)
    grad_checkpoint: bool = False # recompute each block's activations in backward (activation memory for compute)
    fsdp: bool = False            # shard weights, gradients and AdamW state over the ranks (FSDP2; under torchrun)
    log_interval: int = 10        # print and log every N steps {>= 1}
    eval_interval: int = 100      # evaluate every N steps (and at the end); 0 = only at the end {>= 0}
    save_interval: int = 500      # checkpoint every N steps (and at the end); 0 = only at the end {>= 0}
    resume: bool = False          # continue from out_dir/state
    stop_at: int = 0              # end this run after step N with a checkpoint (--resume later); 0 = never {>= 0}
    overwrite: bool = False       # allow a non-empty --out_dir that holds another run (never with --resume)
    report_to: Literal["none", "tensorboard", "wandb"] = "none"  # mirror metrics.jsonl to TensorBoard / W&B
    dist_timeout: float = 10.0    # minutes a rank waits for the others in a collective before the run fails {> 0}
    lora_r: int = 0               # LoRA rank: train rank-r adapters on the frozen --init model; a reference
                                  # that is --init is then the policy with adapters off; 0 = off {>= 0}
    lora_alpha: float = 16.0      # LoRA scale α: the update is (α / r)·B·A {> 0}
    lora_dropout: float = 0.0     # dropout on the adapters' input {0 <= x < 1}
    lora_targets: str = ""        # comma list of nn.Linear names to adapt; empty = attention + MLP
                                  # (GPT-2: c_attn,c_proj,c_fc; Llama: q/k/v/o_proj,gate/up/down_proj)


@dataclass
class FrozenModelOptions:
    """For the scripts that hold a frozen model (a reference, a reward model, a judge) beside the trained one."""
    frozen: Literal["shard", "replicate"] = "shard"  # --fsdp: the frozen reference / reward model sharded too,
                                                     # or whole on every rank
    offload_frozen: bool = False  # keep the frozen models in CPU memory; they visit the GPU for their forwards


@dataclass
class CompileOption:
    """For the scripts whose trained model runs only full-sequence forwards (no sampling with it)."""
    compile: bool = False         # torch.compile the model being trained
