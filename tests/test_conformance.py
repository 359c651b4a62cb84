"""Conformance: training under the offloader is bitwise the training without it, on many models.

Every case builds a tiny model (random init, nothing downloaded) from one initial state, then
trains two deep copies of it for a few SGD steps, seeding torch, numpy and random alike before
each forward: one plainly, one under ``Offloader(CSwapConfig(plan=P, min_bytes=0,
profile_steps=1, budget=None))`` (no budget: ``auto`` moves every site it can). Dropout stays
on (``model.train()``, nonzero dropout, drop-path, LayerDrop, SpecAugment masks and router
jitter wherever the config has them), so both runs must draw the same masks. At every step the
loss, every parameter's gradient (and which ones are None), every input's gradient, every
buffer after the step (BatchNorm's running statistics) and the global RNG state after backward
must be BITWISE equal (the bits are compared, so NaNs and signed zeros count), and under
``raw``/``zvc``/``rle`` every step must have moved bytes (``last_step().offloaded_bytes > 0``
and ``stored_bytes > 0``). Steps: ``raw``/``zvc``/``rle`` 2 (the second reuses what the first
learned), ``auto`` 3 (one measured, two planned by the advisor); the PyTorch modules run 2
more. The negative control, ``plan="int8"`` on BERT, Llama and an LSTM, must DIFFER from the
plain run: the comparison can fail.

Covered:
  * Hugging Face transformers (37 architectures), built from configs: hidden 32, 2 layers,
    4 heads, vocab 99, batch 2, 12 tokens (16x16 or 32x32 images, 400 audio samples), with
    ``attn_implementation`` "eager" and "sdpa" where transformers offers both. Encoders: BERT,
    RoBERTa, DistilBERT, ALBERT, ELECTRA, DeBERTa-v2*, MPNet*. Decoders: GPT-2, GPT-Neo*,
    GPT-J*, GPT-NeoX, Bloom*, Llama, Mistral, Qwen2, Qwen3, Phi, Phi-3, Gemma, Gemma-2*, OPT,
    Falcon. MoE: Mixtral, Qwen2-MoE. State space: Mamba, Mamba2 (no attention). Encoder-decoder:
    T5, BART, Marian. Vision: ViT, DeiT, ConvNeXt and ResNet (no attention), Swin. Audio:
    Wav2Vec2 (CTC), HuBERT, Whisper. Frozen weights: BERT with its embeddings and first layer
    frozen. (* eager only: transformers 5.23 refuses sdpa for them.)
  * PyTorch modules (13): nn.LSTM (inter-layer dropout; proj_size; bidirectional; float64),
    nn.GRU (inter-layer dropout; bidirectional), nn.RNN (tanh; relu), nn.LSTMCell, nn.GRUCell
    and nn.RNNCell unrolled over 5 steps, whose input requires grad (its gradient is compared
    too); a LoRA-like MLP (frozen base Linear layers, trainable low-rank adapters); and an MLP
    whose leaf input does not require grad. (A float32 nn.LSTM without proj_size runs oneDNN's
    fused kernel on the CPU; float64 and proj_size take ATen's cell-by-cell path.)

Every architecture runs with each attention implementation it has under raw, zvc, rle and
auto, every PyTorch module under all four plans, and the three int8 negative controls: 319
cases, under a minute on this project's 2-core CI machine.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from torch import nn

import cswap_lightning as cswap

transformers = pytest.importorskip("transformers")

PLANS = ("raw", "zvc", "rle", "auto")
MUST_MOVE = ("raw", "zvc", "rle")  # plans that offload every tensor they can
STEPS = {"raw": 2, "zvc": 2, "rle": 2, "auto": 3, "int8": 1}
# The PyTorch modules are tiny: two more steps each give a race in the engine (a copy taken
# while ATen still activates a shared storage in place) more chances to show.
MORE_TORCH_STEPS = 2
LR = 0.05
BATCH, SEQ, VOCAB = 2, 12, 99


# inputs and losses ------------------------------------------------------------------------
def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def token_ids(length: int = SEQ, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, vocab, (BATCH, length), generator=_gen(seed))


def hf_loss(model: nn.Module, inputs: dict) -> torch.Tensor:
    return model(**inputs).loss


def projected(out: torch.Tensor, seed: int = 7) -> torch.Tensor:
    """A scalar that depends on every element with a different weight (a plain sum or mean of
    squares is constant under a final LayerNorm and would give degenerate gradients)."""
    weight = torch.randn(out.shape, generator=_gen(seed), dtype=out.dtype).to(out.device)
    return (out * weight).sum()


@dataclass
class Built:
    model: nn.Module
    inputs: dict[str, torch.Tensor]
    loss: Callable[[nn.Module, dict], torch.Tensor] = hf_loss


# Hugging Face architectures ---------------------------------------------------------------
TEXT = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 64, "max_position_embeddings": 64, "pad_token_id": 0}
BERTISH = dict(TEXT, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
LLAMAISH = dict(TEXT, num_key_value_heads=2, attention_dropout=0.1, bos_token_id=1,
                eos_token_id=2)


def hf_class(name: str) -> type:
    """A transformers class by name, looked up when a case runs (collecting stays cheap)."""
    return getattr(transformers, name)


def causal_lm(config_cls: str, **kw) -> Callable[[str], Built]:
    def build(attn: str) -> Built:
        cfg = hf_class(config_cls)(**kw)
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)
        ids = token_ids()
        return Built(model, {"input_ids": ids, "labels": ids})

    build.config = lambda: hf_class(config_cls)(**kw)  # for `cswap plan`'s tests
    return build


def masked_lm(config_cls: str, **kw) -> Callable[[str], Built]:
    def build(attn: str) -> Built:
        cfg = hf_class(config_cls)(**kw)
        model = transformers.AutoModelForMaskedLM.from_config(cfg, attn_implementation=attn)
        ids = token_ids()
        mask = torch.ones_like(ids)
        mask[1, -3:] = 0  # a padded row: the attention mask matters
        return Built(model, {"input_ids": ids, "attention_mask": mask,
                             "labels": token_ids(seed=1)})

    build.config = lambda: hf_class(config_cls)(**kw)  # for `cswap plan`'s tests
    return build


def seq_classifier(config_cls: str, **kw) -> Callable[[str], Built]:
    def build(attn: str) -> Built:
        cfg = hf_class(config_cls)(num_labels=3, **kw)
        model = transformers.AutoModelForSequenceClassification.from_config(
            cfg, attn_implementation=attn)
        return Built(model, {"input_ids": token_ids(), "labels": torch.tensor([0, 2])})

    build.config = lambda: hf_class(config_cls)(**kw)  # for `cswap plan`'s tests
    return build


def seq2seq_lm(config_cls: str, **kw) -> Callable[[str], Built]:
    def build(attn: str) -> Built:
        cfg = hf_class(config_cls)(**kw)
        model = transformers.AutoModelForSeq2SeqLM.from_config(cfg, attn_implementation=attn)
        return Built(model, {"input_ids": token_ids(), "labels": token_ids(8, seed=1)})

    build.config = lambda: hf_class(config_cls)(**kw)  # for `cswap plan`'s tests
    return build


def image_classifier(config_cls: str, image: int = 16, model_cls: str | None = None,
                     **kw) -> Callable[[str], Built]:
    def build(attn: str) -> Built:
        cfg = hf_class(config_cls)(num_labels=3, **kw)
        if model_cls is None:
            model = transformers.AutoModelForImageClassification.from_config(
                cfg, attn_implementation=attn)
        else:  # the Auto class maps DeiT to two classes and cannot choose
            model = hf_class(model_cls)._from_config(cfg, attn_implementation=attn)
        pixels = torch.randn(BATCH, 3, image, image, generator=_gen())
        return Built(model, {"pixel_values": pixels, "labels": torch.tensor([1, 2])})

    return build


def bert_frozen(attn: str) -> Built:
    built = masked_lm("BertConfig", **BERTISH)(attn)
    for p in built.model.bert.embeddings.parameters():
        p.requires_grad_(False)
    for p in built.model.bert.encoder.layer[0].parameters():
        p.requires_grad_(False)
    return built


def wav2vec2_ctc(attn: str) -> Built:
    cfg = transformers.Wav2Vec2Config(
        vocab_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
        num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=4, hidden_dropout=0.1,
        attention_dropout=0.1, activation_dropout=0.1, feat_proj_dropout=0.1, layerdrop=0.1,
        mask_time_prob=0.2, mask_time_length=3, pad_token_id=0)
    model = transformers.AutoModelForCTC.from_config(cfg, attn_implementation=attn)
    audio = torch.randn(BATCH, 400, generator=_gen())
    labels = torch.randint(1, 16, (BATCH, 5), generator=_gen(1))
    return Built(model, {"input_values": audio, "labels": labels})


def hubert_classifier(attn: str) -> Built:
    cfg = transformers.HubertConfig(
        num_labels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
        num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=4, hidden_dropout=0.1,
        attention_dropout=0.1, activation_dropout=0.1, feat_proj_dropout=0.1, layerdrop=0.0,
        mask_time_prob=0.2, mask_time_length=3)
    model = transformers.AutoModelForAudioClassification.from_config(
        cfg, attn_implementation=attn)
    audio = torch.randn(BATCH, 400, generator=_gen())
    return Built(model, {"input_values": audio, "labels": torch.tensor([0, 2])})


def whisper(attn: str) -> Built:
    cfg = transformers.WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=8, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_source_positions=16, max_target_positions=32, dropout=0.1,
        attention_dropout=0.1, activation_dropout=0.1, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, decoder_start_token_id=1)
    model = transformers.WhisperForConditionalGeneration._from_config(
        cfg, attn_implementation=attn)
    features = torch.randn(BATCH, 8, 32, generator=_gen())
    return Built(model, {"input_features": features, "labels": token_ids(8, seed=1)})


SEQ2SEQ = {"vocab_size": VOCAB, "d_model": 32, "encoder_layers": 2, "decoder_layers": 2,
           "encoder_attention_heads": 4, "decoder_attention_heads": 4, "encoder_ffn_dim": 64,
           "decoder_ffn_dim": 64, "max_position_embeddings": 64, "dropout": 0.1,
           "attention_dropout": 0.1, "activation_dropout": 0.1, "pad_token_id": 0,
           "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 1}

# name -> (builder taking attn_implementation, the implementations the model supports)
EAGER_SDPA = ("eager", "sdpa")
EAGER = ("eager",)
HF: dict[str, tuple[Callable[[str], Built], tuple[str, ...]]] = {
    # encoders
    "bert": (masked_lm("BertConfig", **BERTISH), EAGER_SDPA),
    "roberta": (masked_lm("RobertaConfig", **dict(BERTISH, max_position_embeddings=66)),
                EAGER_SDPA),
    "distilbert": (masked_lm("DistilBertConfig", vocab_size=VOCAB, dim=32, n_layers=2,
                             n_heads=4, hidden_dim=64, dropout=0.1, attention_dropout=0.1,
                             max_position_embeddings=64, pad_token_id=0), EAGER_SDPA),
    "albert": (masked_lm("AlbertConfig", **dict(BERTISH, embedding_size=16)), EAGER_SDPA),
    "electra": (masked_lm("ElectraConfig", **dict(BERTISH, embedding_size=16)), EAGER_SDPA),
    "deberta_v2": (seq_classifier("DebertaV2Config", **dict(BERTISH, pooler_dropout=0.1)),
                   EAGER),
    "mpnet": (masked_lm("MPNetConfig", **BERTISH), EAGER),
    # decoders
    "gpt2": (causal_lm("GPT2Config", vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                       n_positions=64, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1,
                       bos_token_id=1, eos_token_id=2), EAGER_SDPA),
    "gpt_neo": (causal_lm("GPTNeoConfig", vocab_size=VOCAB, hidden_size=32, num_layers=2,
                          num_heads=4, attention_types=[[["global", "local"], 1]],
                          window_size=4, max_position_embeddings=64, embed_dropout=0.1,
                          attention_dropout=0.1, resid_dropout=0.1, bos_token_id=1,
                          eos_token_id=2), EAGER),
    "gptj": (causal_lm("GPTJConfig", vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                       rotary_dim=4, n_positions=64, resid_pdrop=0.1, embd_pdrop=0.1,
                       attn_pdrop=0.1, bos_token_id=1, eos_token_id=2), EAGER),
    "gpt_neox": (causal_lm("GPTNeoXConfig", **dict(TEXT, attention_dropout=0.1,
                                                   hidden_dropout=0.1)), EAGER_SDPA),
    "bloom": (causal_lm("BloomConfig", vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4,
                        hidden_dropout=0.1, attention_dropout=0.1), EAGER),
    "llama": (causal_lm("LlamaConfig", **LLAMAISH), EAGER_SDPA),
    "mistral": (causal_lm("MistralConfig", **dict(LLAMAISH, sliding_window=4)), EAGER_SDPA),
    "qwen2": (causal_lm("Qwen2Config", **LLAMAISH), EAGER_SDPA),
    "qwen3": (causal_lm("Qwen3Config", **dict(LLAMAISH, head_dim=8)), EAGER_SDPA),
    "phi": (causal_lm("PhiConfig", **dict(TEXT, resid_pdrop=0.1, embd_pdrop=0.1,
                                           attention_dropout=0.1)), EAGER_SDPA),
    "phi3": (causal_lm("Phi3Config", **dict(LLAMAISH, resid_pdrop=0.1, embd_pdrop=0.1)),
             EAGER_SDPA),
    "gemma": (causal_lm("GemmaConfig", **dict(LLAMAISH, head_dim=8)), EAGER_SDPA),
    "gemma2": (causal_lm("Gemma2Config", **dict(LLAMAISH, head_dim=8, sliding_window=4)),
               EAGER),  # transformers 5.23 refuses sdpa for Gemma-2
    "opt": (causal_lm("OPTConfig", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                      num_attention_heads=4, ffn_dim=64, max_position_embeddings=64,
                      word_embed_proj_dim=32, dropout=0.1, attention_dropout=0.1,
                      pad_token_id=0), EAGER_SDPA),
    "falcon": (causal_lm("FalconConfig", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                         num_attention_heads=4, hidden_dropout=0.1, attention_dropout=0.1),
               EAGER_SDPA),
    # mixture of experts
    "mixtral": (causal_lm("MixtralConfig", **dict(LLAMAISH, num_local_experts=4,
                                                  num_experts_per_tok=2,
                                                  router_jitter_noise=0.1)), EAGER_SDPA),
    "qwen2_moe": (causal_lm("Qwen2MoeConfig", **dict(LLAMAISH, num_experts=4,
                                                     num_experts_per_tok=2,
                                                     moe_intermediate_size=32,
                                                     shared_expert_intermediate_size=32,
                                                     decoder_sparse_step=1)), EAGER_SDPA),
    # state-space models
    "mamba": (causal_lm("MambaConfig", vocab_size=VOCAB, hidden_size=32, state_size=8,
                        num_hidden_layers=2, expand=2, conv_kernel=4), (None,)),
    "mamba2": (causal_lm("Mamba2Config", vocab_size=VOCAB, hidden_size=32, state_size=8,
                         num_hidden_layers=2, expand=2, num_heads=8, head_dim=8, n_groups=1,
                         conv_kernel=4, chunk_size=8), (None,)),
    # encoder-decoders
    "t5": (seq2seq_lm("T5Config", vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64,
                      num_layers=2, num_heads=4, dropout_rate=0.1, decoder_start_token_id=0,
                      pad_token_id=0), EAGER_SDPA),
    "bart": (seq2seq_lm("BartConfig", **SEQ2SEQ), EAGER_SDPA),
    "marian": (seq2seq_lm("MarianConfig", **SEQ2SEQ), EAGER_SDPA),
    # vision
    "vit": (image_classifier("ViTConfig", image_size=16, patch_size=4, hidden_size=32,
                             num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                             hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1),
            EAGER_SDPA),
    "deit": (image_classifier("DeiTConfig", model_cls="DeiTForImageClassification",
                              image_size=16, patch_size=4, hidden_size=32,
                              num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                              hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1),
             EAGER_SDPA),
    "convnext": (image_classifier("ConvNextConfig", image=32, hidden_sizes=[8, 16],
                                  depths=[1, 1], num_stages=2, drop_path_rate=0.1), (None,)),
    "resnet": (image_classifier("ResNetConfig", embedding_size=8, hidden_sizes=[8, 16],
                                depths=[1, 1], layer_type="basic"), (None,)),
    "swin": (image_classifier("SwinConfig", image=32, image_size=32, patch_size=4,
                              embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=2,
                              drop_path_rate=0.1, hidden_dropout_prob=0.1,
                              attention_probs_dropout_prob=0.1), EAGER_SDPA),
    # audio
    "wav2vec2": (wav2vec2_ctc, EAGER_SDPA),
    "hubert": (hubert_classifier, EAGER_SDPA),
    "whisper": (whisper, EAGER_SDPA),
    # frozen weights in a transformer
    "bert_frozen": (bert_frozen, EAGER_SDPA),
}


def build_hf(name: str, attn: str | None) -> Built:
    builder, _ = HF[name]
    torch.manual_seed(0)
    built = builder(attn)
    return built


# PyTorch modules --------------------------------------------------------------------------
class Unrolled(nn.Module):
    """A recurrent cell unrolled over the sequence (LSTMCell, GRUCell, RNNCell)."""

    def __init__(self, cell: nn.Module, steps: int = 5) -> None:
        super().__init__()
        self.cell, self.steps = cell, steps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = None
        outs = []
        for t in range(self.steps):
            state = self.cell(x[:, t], state)
            outs.append(state[0] if isinstance(state, tuple) else state)
        return torch.stack(outs, 1)


class Recurrent(nn.Module):
    """nn.LSTM / nn.GRU / nn.RNN: the output sequence and the final states, concatenated."""

    def __init__(self, rnn: nn.Module) -> None:
        super().__init__()
        self.rnn = rnn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, state = self.rnn(x)
        states = state if isinstance(state, tuple) else (state,)
        return torch.cat([out.flatten()] + [s.flatten() for s in states])


class LoRALinear(nn.Module):
    def __init__(self, d_in: int, d_out: int, rank: int = 4) -> None:
        super().__init__()
        self.base = nn.Linear(d_in, d_out).requires_grad_(False)
        self.a = nn.Linear(d_in, rank, bias=False)
        self.b = nn.Linear(rank, d_out, bias=False)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.b(self.a(self.drop(x)))


def torch_case(model: nn.Module, x: torch.Tensor) -> Built:
    return Built(model, {"x": x}, lambda m, inputs: projected(m(inputs["x"])))


def recurrent_input(dtype=torch.float32) -> torch.Tensor:
    return torch.randn(BATCH, 5, 8, generator=_gen(), dtype=dtype).requires_grad_(True)


TORCH: dict[str, Callable[[], Built]] = {
    "lstm": lambda: torch_case(Recurrent(nn.LSTM(8, 16, 2, batch_first=True, dropout=0.1)),
                               recurrent_input()),
    "lstm_proj": lambda: torch_case(
        Recurrent(nn.LSTM(8, 16, 2, batch_first=True, proj_size=6)), recurrent_input()),
    "lstm_bidirectional": lambda: torch_case(
        Recurrent(nn.LSTM(8, 16, 2, batch_first=True, bidirectional=True)), recurrent_input()),
    "lstm_float64": lambda: torch_case(
        Recurrent(nn.LSTM(8, 16, 2, batch_first=True).double()),
        recurrent_input(torch.float64)),
    "gru": lambda: torch_case(Recurrent(nn.GRU(8, 16, 2, batch_first=True, dropout=0.1)),
                              recurrent_input()),
    "gru_bidirectional": lambda: torch_case(
        Recurrent(nn.GRU(8, 16, 2, batch_first=True, bidirectional=True)), recurrent_input()),
    "rnn_tanh": lambda: torch_case(Recurrent(nn.RNN(8, 16, 2, batch_first=True)),
                                   recurrent_input()),
    "rnn_relu": lambda: torch_case(
        Recurrent(nn.RNN(8, 16, 2, batch_first=True, nonlinearity="relu")), recurrent_input()),
    "lstm_cell_x5": lambda: torch_case(Unrolled(nn.LSTMCell(8, 16)), recurrent_input()),
    "gru_cell_x5": lambda: torch_case(Unrolled(nn.GRUCell(8, 16)), recurrent_input()),
    "rnn_cell_x5": lambda: torch_case(Unrolled(nn.RNNCell(8, 16)), recurrent_input()),
    "lora_mlp": lambda: torch_case(
        nn.Sequential(LoRALinear(16, 32), nn.GELU(), LoRALinear(32, 32), nn.ReLU(),
                      nn.Linear(32, 4)),
        torch.randn(BATCH, 6, 16, generator=_gen())),
    "mlp_input_no_grad": lambda: torch_case(
        nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.1), nn.Tanh(), nn.Linear(32, 4)),
        torch.randn(BATCH, 6, 16, generator=_gen())),
}


def build_torch(name: str, attn: None = None) -> Built:
    torch.manual_seed(0)
    return TORCH[name]()


# the comparison ---------------------------------------------------------------------------
@dataclass
class Step:
    loss: torch.Tensor
    grads: dict[str, torch.Tensor | None]  # parameters' and inputs' (None where unset)
    buffers: dict[str, torch.Tensor]  # after the step (BatchNorm's running statistics)
    rng: torch.Tensor  # the global RNG state after backward
    stats: cswap.StepStats | None = None  # the offloader's last_step(), under the offloader


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)  # Wav2Vec2 and HuBERT draw their time masks with numpy
    random.seed(seed)


def train(built: Built, steps: int, offloader: cswap.Offloader | None = None,
          prepare: Callable[[nn.Module], object] | None = None,
          modes: tuple[bool, bool] = (True, True),
          dropped: frozenset[int] = frozenset()) -> list[Step]:
    """``steps`` SGD steps of a deep copy of ``built``, seeded alike before each forward
    (``prepare``: called with the copy first); ``modes``: the model's training flag in
    forward and in backward (``model.eval()`` between them, say); the forwards numbered in
    ``dropped`` have their graph dropped without a backward (a step skipped), unrecorded."""
    model = copy.deepcopy(built.model).train()
    if prepare is not None:
        prepare(model)
    inputs = {k: v.detach().clone().requires_grad_(v.requires_grad)
              for k, v in built.inputs.items()}
    record = []
    for i in range(steps):
        model.zero_grad(set_to_none=True)
        for v in inputs.values():
            v.grad = None
        seed_all(1000 + i)
        model.train(modes[0])
        if offloader is None:
            loss = built.loss(model, inputs)
        else:
            with offloader:
                loss = built.loss(model, inputs)
        if i in dropped:
            del loss
            continue
        model.train(modes[1])
        loss.backward()
        # a recomputation runs as forward ran and leaves every flag as backward found it
        assert all(m.training == modes[1] for m in model.modules())
        rng = torch.get_rng_state()
        stats = offloader.last_step() if offloader is not None else None
        grads = {f"param {n}": None if p.grad is None else p.grad.clone()
                 for n, p in model.named_parameters()}
        grads |= {f"input {k}": v.grad.clone() for k, v in inputs.items() if v.requires_grad}
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p.sub_(LR * p.grad)
        buffers = {n: b.clone() for n, b in model.named_buffers()}
        record.append(Step(loss.detach().clone(), grads, buffers, rng, stats))
        del loss
    return record


_INT = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def same_bits(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype == torch.bool or not (a.is_floating_point() or a.is_complex()):
        return torch.equal(a, b)
    return torch.equal(a.contiguous().view(_INT[a.element_size()]),
                       b.contiguous().view(_INT[b.element_size()]))


def describe(a: torch.Tensor | None, b: torch.Tensor | None) -> str:
    if a is None or b is None:
        return f"grad is {'None' if a is None else 'set'} in the reference, " \
               f"{'None' if b is None else 'set'} under the offloader"
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"{tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
    a64, b64 = a.detach().double(), b.detach().double()
    nan = torch.isnan(a64) != torch.isnan(b64)
    both = ~(torch.isnan(a64) | torch.isnan(b64))
    diff = (a64 - b64)[both].abs()
    worst = diff.max().item() if diff.numel() else 0.0
    scale = a64[both].abs().max().item() if both.any() else 0.0
    return (f"max abs diff {worst:.3g} (reference max |x| {scale:.3g}), "
            f"{int((a64 != b64).sum())}/{a.numel()} elements differ"
            + (f", {int(nan.sum())} NaN mismatches" if nan.any() else ""))


def differences(ref: list[Step], got: list[Step]) -> list[str]:
    """Everything that differs at the first step where anything does."""
    for i, (r, g) in enumerate(zip(ref, got)):
        bad = []
        if not same_bits(r.loss, g.loss):
            bad.append(f"loss: {r.loss.item()!r} vs {g.loss.item()!r}")
        for name in r.grads:
            if not same_bits(r.grads[name], g.grads.get(name)):
                bad.append(f"grad of {name}: {describe(r.grads[name], g.grads.get(name))}")
        for name in r.buffers:
            if not same_bits(r.buffers[name], g.buffers[name]):
                bad.append(f"buffer {name}: {describe(r.buffers[name], g.buffers[name])}")
        if not same_bits(r.rng, g.rng):
            bad.append("the global RNG state after backward differs (the library drew from it)")
        if bad:
            return [f"step {i}:"] + bad
    return []


_REFERENCE: dict[tuple[str, str | None], tuple[Built, list[Step]]] = {}


def reference(kind: str, name: str, attn: str | None, steps: int) -> tuple[Built, list[Step]]:
    """The model's initial state and its plain training, cached across plans."""
    key = (name, attn)
    if key not in _REFERENCE or len(_REFERENCE[key][1]) < steps:
        built = build_hf(name, attn) if kind == "hf" else build_torch(name)
        _REFERENCE[key] = (built, train(built, steps))
    built, record = _REFERENCE[key]
    return built, record[:steps]


def offloaded(built: Built, plan: str, steps: int) -> list[Step]:
    config = cswap.CSwapConfig(plan=plan, min_bytes=0, profile_steps=1, budget=None)
    offloader = cswap.Offloader(config)
    try:
        return train(built, steps, offloader)
    finally:
        offloader.close()


def problems(kind: str, name: str, attn: str | None, plan: str) -> list[str]:
    """How training under ``plan`` differs from the plain run (every bit compared), and the
    steps of a plan that must move bytes that moved none."""
    steps = STEPS[plan] + (MORE_TORCH_STEPS if kind == "torch" else 0)
    built, ref = reference(kind, name, attn, steps)
    got = offloaded(built, plan, steps)
    found = differences(ref, got)
    if plan in MUST_MOVE:
        found += [f"step {i} offloaded nothing:\n{step.stats.table()}" for i, step in
                  enumerate(got) if not (step.stats.offloaded_bytes and step.stats.stored_bytes)]
    return found


# the cases --------------------------------------------------------------------------------
# An encoder, a decoder and a decoder with grouped-query attention run in `make test-fast`;
# the other architectures (4 minutes more on a 2-core machine) in `make test`.
FAST_HF = ("bert", "gpt2", "llama")


def hf_cases() -> list:
    return [pytest.param(name, attn, plan, id=f"{name}-{attn}-{plan}",
                         marks=() if name in FAST_HF else pytest.mark.slow)
            for name, (_, attns) in HF.items() for attn in attns for plan in PLANS]


@pytest.mark.parametrize(("name", "attn", "plan"), hf_cases())
def test_hf_model_trains_bitwise_alike(name, attn, plan):
    found = problems("hf", name, attn, plan)
    assert not found, f"{name} attn={attn} plan={plan}:\n  " + "\n  ".join(found)


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("name", list(TORCH))
def test_torch_module_trains_bitwise_alike(name, plan):
    found = problems("torch", name, None, plan)
    assert not found, f"{name} plan={plan}:\n  " + "\n  ".join(found)


@pytest.mark.parametrize(("kind", "name", "attn"),
                         [("hf", "bert", "eager"), ("hf", "llama", "sdpa"),
                          ("torch", "lstm", None)])
def test_lossy_plan_is_caught(kind, name, attn):
    """The negative control: int8 loses bits, and the comparison above must see it."""
    built, ref = reference(kind, name, attn, STEPS["int8"])
    got = offloaded(built, "int8", STEPS["int8"])
    assert differences(ref, got), "int8 gave the reference's exact bits: the comparison is blind"
    assert got[0].stats.offloaded_bytes > 0
