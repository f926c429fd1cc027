"""The target model: a Hugging Face causal LM behind a small interface the decoding loop needs.

One forward over new tokens on a KV cache returns their logits, the outputs of chosen decoder layers (the drafter's
context features) and the final normed hidden state, all from the same pass; the cache rolls back per row. Nothing
here knows about drafting. The families our decoder runs are decoder.SUPPORTED_FAMILIES; prompts are encoded by
dspark.chat.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from dspark import models
from dspark.chat import encode_text, prompt_ids
from dspark.decoder import LeanDecoder, real_positions
from dspark.errors import DSparkError
from dspark.head import LMHead
from dspark.kvcache import KVCache
from dspark.products import packing_available

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise DSparkError(f"unknown dtype '{name}'; use one of {', '.join(DTYPES)}")
    return DTYPES[name]


def default_layer_ids(num_layers: int, count: int = 5) -> list[int]:
    """`count` decoder layers spread evenly over [1, L-2]; never the final layer (docs/design.md §2)."""
    lo, hi = 1, num_layers - 2
    if hi < lo:
        raise DSparkError(f"a target needs at least 3 decoder layers to feed a drafter (it has {num_layers})")
    count = min(count, hi - lo + 1)
    if count == 1:
        return [hi]
    return sorted({round(lo + i * (hi - lo) / (count - 1)) for i in range(count)})


def resolve_device(device: str, local_rank: int = 0) -> torch.device:
    """--device as a torch device, refused with the fix when this machine lacks it; auto: this rank's GPU if CUDA is
    available, else the CPU."""
    if device == "auto":
        device = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise DSparkError(f"--device {device!r} is not a device name; use auto, cpu or cuda:N") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise DSparkError(f"--device {device}: this machine has no CUDA GPU; use --device cpu (or auto)")
    if dev.type == "cuda" and (dev.index or 0) >= torch.cuda.device_count():
        raise DSparkError(f"--device {device}: only {torch.cuda.device_count()} GPU(s) here")
    return torch.device("cuda", dev.index or 0) if dev.type == "cuda" else dev  # CUDA calls want the index


@dataclass
class TargetOutput:
    logits: torch.Tensor | None  # [B, n, V] float32
    features: torch.Tensor | None  # [B, n, len(layer_ids) * d], model dtype
    last_hidden: torch.Tensor | None  # [B, n, d] final normed hidden state


# Precisions a target runs in. int8 and int4 are weight-only (int8: per-channel scales; int4: a step and minimum
# per group of 32 columns) with bfloat16 activations.
PRECISIONS = ("float32", "bfloat16", "int8", "int4")
QUANTIZED = ("int8", "int4")


class Target:
    def __init__(self, model, tokenizer, name: str, layer_ids: list[int] | None = None):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name
        self.config = model.config
        self.lm_head = model.get_output_embeddings()
        self.quantization: str | None = None  # "int8" / "int4" after quantize()
        self.quantization_error = 0.0  # the largest relative change quantizing made to a weight (Int4Weight.error)
        self.decoder = LeanDecoder(self.model)
        self.head = LMHead(
            self.lm_head.weight, self.decoder.min_rows, getattr(self.config, "final_logit_softcapping", None)
        )
        self.num_layers = self.config.num_hidden_layers
        self.layer_ids = list(layer_ids) if layer_ids is not None else default_layer_ids(self.num_layers)
        self.validate_layer_ids(self.layer_ids)
        for p in self.model.parameters():
            p.requires_grad_(False)

    # ---- construction ------------------------------------------------------------------------------------------
    @classmethod
    def load(
        cls,
        name_or_path: str = models.DEFAULT_TARGET,
        dtype="float32",
        layer_ids=None,
        device="cpu",
        quantize: str | None = None,
    ) -> Target:
        path = models.resolve(name_or_path)
        try:
            config = AutoConfig.from_pretrained(path)
        except Exception as e:
            raise DSparkError(f"{path} has no readable model config: {e}") from e
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            raise DSparkError(
                f"{path} holds a '{config.model_type}' model, which is not a causal language model; "
                "dspark needs a decoder-only LM (Llama, Qwen, Gemma ...)."
            )
        hf_logging.disable_progress_bar()  # a 2-second load needs no progress bar; conversion keeps its own
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=parse_dtype(dtype))
            tokenizer = AutoTokenizer.from_pretrained(path)
        except OSError as e:
            raise DSparkError(f"cannot load the model in {path}: {e}") from e
        finally:
            hf_logging.enable_progress_bar()
        target = cls(model.to(device), tokenizer, name=name_or_path, layer_ids=layer_ids)
        if quantize not in (None, "none", *QUANTIZED):
            raise DSparkError(f"unknown quantization '{quantize}'; use {' or '.join(QUANTIZED)} (weight-only) or none")
        return target.quantize(quantize) if quantize in QUANTIZED else target

    def validate_layer_ids(self, layer_ids: list[int]) -> None:
        for i in layer_ids:
            if not 0 <= i < self.num_layers - 1:
                raise DSparkError(
                    f"target_layer_ids: {i} is outside [0, {self.num_layers - 2}] for a target of "
                    f"{self.num_layers} layers (the final layer is never a drafter feature)"
                )

    # ---- facts -------------------------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def context_window(self) -> int | None:
        return getattr(self.config, "max_position_embeddings", None)

    @property
    def vocab_size(self) -> int:
        return self.lm_head.weight.shape[0]

    @property
    def embed_tokens(self) -> torch.nn.Embedding:
        return self.model.get_input_embeddings()

    @cached_property
    def fingerprint(self) -> str:
        return models.fingerprint(self.config, self.tokenizer, self.model)

    @property
    def stop_token_ids(self) -> set[int]:
        ids = set()
        for source in (self.config, getattr(self.model, "generation_config", None)):
            eos = getattr(source, "eos_token_id", None)
            ids.update([eos] if isinstance(eos, int) else (eos or []))
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def encode_chat(self, messages: list[dict] | str) -> list[int]:
        """Token ids of a chat prompt (the model's own template), ready for the assistant's reply."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        if not messages or not any(m.get("content", "").strip() for m in messages):
            raise DSparkError("the prompt is empty; give the model something to answer")
        return prompt_ids(self.tokenizer, messages)

    def user_turn_template(self) -> tuple[list[int], int]:
        """What the chat template writes around a user's message: the ids before its content (the conversation's
        opening up to the user turn, a default system turn included) and the first id after it (the token that
        closes the turn). An instruction-tuned model given only the opening writes a user request of its own."""
        if not self.tokenizer.chat_template:
            raise DSparkError(f"{self.name} has no chat template, so it has no user turn to write")
        mark = "\ue000user\ue001"
        before, _, after = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": mark}], tokenize=False
        ).partition(mark)
        closing = self.tokenizer(after, add_special_tokens=False)["input_ids"]
        if not closing:
            raise DSparkError(f"{self.name}'s chat template writes nothing after a user message; its turns cannot end")
        return self.tokenizer(before, add_special_tokens=False)["input_ids"], closing[0]

    def encode_text(self, text: str) -> list[int]:
        """Token ids of a raw-text prompt (no chat template), control-token spellings kept as text."""
        if not text.strip():
            raise DSparkError("the prompt is empty; give the model something to answer")
        return encode_text(self.tokenizer, text)

    def unused_token_id(self) -> int:
        """A token id the target never emits in chat, for the drafter's mask token: the first embedding row beyond
        the tokenizer if there is one, else the last special token that the chat template does not use."""
        if self.vocab_size > len(self.tokenizer):
            return len(self.tokenizer)
        template = (
            self.tokenizer.apply_chat_template(
                [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], tokenize=False
            )
            if self.tokenizer.chat_template
            else ""
        )
        used = {
            self.tokenizer.bos_token_id,
            self.tokenizer.eos_token_id,
            self.tokenizer.pad_token_id,
            self.tokenizer.unk_token_id,
        } | self.stop_token_ids
        candidates = [
            idx
            for tok, idx in self.tokenizer.get_added_vocab().items()
            if idx not in used and tok not in template and idx < self.vocab_size
        ]
        if not candidates:
            raise DSparkError("the target has no unused token for the drafter's mask; set mask_token_id explicitly")
        return max(candidates)

    def identity(self) -> dict:
        return {"name_or_path": self.name, "fingerprint": self.fingerprint, "model_type": self.config.model_type}

    # ---- compute -----------------------------------------------------------------------------------------------
    def new_cache(self, batch_size: int, capacity: int = 0) -> KVCache:
        return self.decoder.new_cache(batch_size, capacity)

    def logits_from_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head.logits(hidden)

    def use_packed_weights(self, packed: bool) -> Target:
        """Every matrix the decode step streams, LM head included, as products.PackedWeight (or not); a float16 head
        (LMHead.use_float16) stays, and returns to this form when switched off."""
        self.decoder.pack(packed)
        self.head.use_packed(packed)
        return self

    @property
    def quantized(self) -> bool:
        return self.quantization is not None

    @property
    def keeps_weights(self) -> bool:
        """Whether every weight is where bfloat16 would have put it, within a few of its steps: true of float32 and
        bfloat16, and of int4 for a model whose weights come from a 4-bit file of the same layout (the shipped
        target's), which loses nothing more to it than to bfloat16."""
        return self.quantization_error <= 2**-6

    @property
    def precision(self) -> str:
        """Which of PRECISIONS this target runs in."""
        return self.quantization or str(self.dtype).removeprefix("torch.")

    def quantize(self, kind: str) -> Target:
        """Weight-only int8 or int4 for every matrix of the layers. The LM head is int8 in int8; in int4 it stays in
        the activations' precision (packed where oneDNN runs it): it is the tied embedding, which 4-bit files keep
        at 8 bits too. Plain and speculative decoding both run this quantized target, so they still agree token for
        token."""
        if self.device.type != "cpu":
            raise DSparkError(f"{kind} runs on CPUs only (PyTorch's CPU kernels); on a GPU use bfloat16")
        self.quantization_error = self.decoder.quantize(8 if kind == "int8" else 4)
        if kind == "int8":
            self.head.use_int8()
        else:
            self.head.use_packed(packing_available(self.lm_head.weight))
        self.quantization = kind
        return self

    @torch.no_grad()
    def forward(
        self,
        cache: KVCache,
        input_ids: torch.Tensor,
        num_new: torch.Tensor | None = None,
        *,
        logits: bool | str = True,
        features: bool | list[int] = False,
        last_hidden: bool = False,
        prefill: bool = False,
    ) -> TargetOutput:
        """Append input_ids [B, n] to the cache (row b: its first num_new[b] are real, the rest padding).

        logits: True for every new position, "last" for each row's last real one only ([B, 1, V]; what a prefill
        needs: the LM head over a whole prompt is most of a prefill's cost), False for none.
        features: the outputs of these decoder layers, concatenated (True: the target's default `layer_ids`).
        prefill: the rows are prompts (`prefill`)."""
        batch, width = input_ids.shape
        if num_new is None:
            num_new = torch.full((batch,), width, dtype=torch.long, device=input_ids.device)
        layer_ids = self.layer_ids if features is True else (features or [])
        hidden, captured = self.decoder.forward(cache, input_ids, num_new, layer_ids, prefill)
        scores = None
        if logits == "last":
            scores = self.logits_from_hidden(hidden[torch.arange(batch, device=hidden.device), num_new - 1][:, None])
        elif logits and (real := real_positions(num_new, width)) is not None:
            # The LM head, the largest matrix, runs over the real positions of a ragged forward only.
            packed = self.logits_from_hidden(hidden[real])
            scores = packed.new_zeros(batch, width, packed.shape[-1])
            scores[real] = packed
        elif logits:
            scores = self.logits_from_hidden(hidden)
        return TargetOutput(
            logits=scores,
            features=torch.cat(captured, dim=-1) if captured else None,
            last_hidden=hidden if last_hidden else None,
        )

    def prefill(
        self, cache: KVCache, input_ids: torch.Tensor, num_new: torch.Tensor | None = None, features=False
    ) -> TargetOutput:
        """Read prompts into a cache: the logits of each row's last token ([B, 1, V]) and the features asked for. A
        quantized target reads them with its float weights (LeanDecoder.quantize) and generates with its quantized
        ones; every decoding loop prefills through here, so plain and speculative decoding still agree token for
        token."""
        return self.forward(cache, input_ids, num_new, logits="last", features=features, prefill=True)

    @torch.no_grad()
    def forward_sequences(self, input_ids: torch.Tensor, lengths: torch.Tensor | None = None, **want) -> TargetOutput:
        """One cache-free pass over whole (right-padded) sequences: what training and regeneration need."""
        return self.forward(self.new_cache(input_ids.shape[0], input_ids.shape[1]), input_ids, lengths, **want)


def load_precision(name_or_path: str, precision: str, **kwargs) -> Target:
    """The target in one of PRECISIONS."""
    if precision in QUANTIZED:
        return Target.load(name_or_path, dtype="bfloat16", quantize=precision, **kwargs)
    return Target.load(name_or_path, dtype=precision, **kwargs)
