"""Train a causal language model with the Hugging Face Trainer, its saved activations offloaded
by cswap: one callback.

A 2-layer Llama built from a config (random weights: nothing is downloaded) learns token
sequences generated in code; it runs on the CPU in seconds, and on a GPU if there is one.
``--lora`` trains LoRA adapters instead of every weight (peft, in the ``hf`` extra);
``--qlora`` trains them on the model loaded in 4 bits, as the QLoRA recipe loads a checkpoint
(bitsandbytes, in the ``qlora`` extra; its CPU kernels run here too)::

    python examples/hf_trainer.py [--steps 30] [--lora | --qlora] [--output-dir hf-example]

At the end the callback prints the measured peak of saved tensors beside what keeping them all
holds, and writes a per-site summary and the memory timeline to the output directory.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from cswap_lightning import CSwapCallback, CSwapConfig
from cswap_lightning.recipes.tokens import TokenSequences

VOCAB, LENGTH = 256, 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    tuning = parser.add_mutually_exclusive_group()
    tuning.add_argument("--lora", action="store_true", help="train LoRA adapters (peft)")
    tuning.add_argument("--qlora", action="store_true",
                        help="train LoRA adapters on the model loaded in 4 bits (bitsandbytes)")
    parser.add_argument("--output-dir", default="hf-example")
    args = parser.parse_args()

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=512,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=LENGTH)
    model = LlamaForCausalLM(config)
    if args.qlora:
        from peft import prepare_model_for_kbit_training
        from transformers import BitsAndBytesConfig

        four_bit = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                      bnb_4bit_use_double_quant=True,
                                      bnb_4bit_compute_dtype=torch.bfloat16)
        with tempfile.TemporaryDirectory() as checkpoint:  # in place of a downloaded one
            model.save_pretrained(checkpoint)
            model = LlamaForCausalLM.from_pretrained(checkpoint, quantization_config=four_bit,
                                                     dtype=torch.bfloat16)
        # the engine decides what to recompute: no checkpointing of the model's own
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    if args.lora or args.qlora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                                 target_modules=["q_proj", "v_proj", "up_proj"]))
        model.print_trainable_parameters()
    # Any dataset of input_ids and labels; these are arithmetic progressions of token ids.
    data = TokenSequences("causal_lm", num_samples=512, seq_len=LENGTH, vocab_size=VOCAB,
                          num_labels=1, seed=0)
    training = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=16,
        learning_rate=1e-2 if args.lora or args.qlora else 3e-3, logging_steps=5,
        save_strategy="no", report_to="none", disable_tqdm=True,
    )
    # budget=None moves every saved tensor it can, to show the engine at work on a model
    # this small; the default, budget="auto", moves only what the device cannot hold.
    cswap = CSwapCallback(CSwapConfig(budget=None, min_bytes=64 * 1024))
    trainer = Trainer(model, training, train_dataset=data, callbacks=[cswap])
    trainer.train()

    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    print(f"loss: first logged {losses[0]:.3f}, last {losses[-1]:.3f}")


if __name__ == "__main__":
    main()
