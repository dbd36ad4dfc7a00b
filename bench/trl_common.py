"""What bench/trl_grpo.py and bench/trl_online_dpo.py share: a nano_rlhf SFT directory made into a transformers model
and tokenizer with nano_rlhf's special tokens, and a TRL trainer run that saves a model directory nano_rlhf's
evaluate reads, TRL's log (OUT/trl_log.jsonl, one line per logged step, with the wall-clock seconds) and a summary
(OUT/trl_summary.json). Run only in TRL's own virtual environment; nano_rlhf never imports it."""
import json
import os
import time


def model_and_tokenizer(init):
    """(nano_rlhf tokenizer, transformers tokenizer, transformers model) of an SFT directory, the end-of-text and pad
    tokens those nano_rlhf reads from the directory."""
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from nano_rlhf.training import load_tokenizer
    ours = load_tokenizer("", init)
    tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(init, "tokenizer.json"))
    eos = tok.convert_ids_to_tokens(ours.eos_id)
    tok.eos_token = eos
    # a pad id outside the vocabulary (GPT-2's rule) cannot be a transformers token: pad with eos, masked out
    tok.pad_token = tok.convert_ids_to_tokens(ours.pad_id) if ours.pad_id is not None and \
        ours.pad_id < len(tok) else eos
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(init)
    model.generation_config.eos_token_id = ours.eos_id
    model.generation_config.pad_token_id = tok.pad_token_id
    return ours, tok, model


def train_and_save(make_trainer, ours, out_dir, settings, config_name, config):
    """make_trainer(callbacks) -> a TRL trainer; train it with a callback recording TRL's log, then save the model,
    nano_rlhf's tokenizer, the log and the summary under out_dir. Returns the training seconds."""
    from transformers import TrainerCallback
    log, t0 = [], [0.0]

    class Log(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs:
                log.append(dict(logs, step=state.global_step, wall=time.time() - t0[0]))

    trainer = make_trainer([Log()])
    t0[0] = time.time()
    trainer.train()
    seconds = time.time() - t0[0]
    os.makedirs(out_dir, exist_ok=True)
    trainer.model.save_pretrained(out_dir)
    ours.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "trl_log.jsonl"), "w") as f:
        for row in log:
            f.write(json.dumps(row) + "\n")
    with open(os.path.join(out_dir, "trl_summary.json"), "w") as f:
        json.dump({"train_seconds": round(seconds, 1), "settings": settings,
                   config_name: {k: str(v) for k, v in config.to_dict().items()}}, f, indent=1)
    return seconds
