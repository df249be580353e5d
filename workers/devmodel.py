"""Build the small development model: a Llama-architecture network with random weights and a
byte-level BPE tokenizer trained here, so development and CI never download anything.

The build is deterministic for a given ``DevModelSpec``: the tokenizer trains on a corpus
generated from a fixed seed, and the weights come from a seeded initialisation. The output is
an ordinary Hugging Face model folder that vLLM loads like any other.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

SPEC_FILE: Final = "kvgate-devmodel.json"
SERVE_ARGS_FILE: Final = "kvgate-serve-args.json"  # read by workers.vllm_engine
_TOOL_TOKENS: Final = ["<tool_call>", "</tool_call>"]

# A chat template in the Llama-3 style, written for this tokenizer's special tokens, that also
# renders tools, assistant tool calls and tool results the way Hermes-style models do
# (``<tool_call>{"name": ..., "arguments": ...}</tool_call>``), so that vLLM's ``hermes``
# tool-call parser reads what the model writes. A conversation without tools renders exactly
# as before tools were added.
CHAT_TEMPLATE: Final = (
    "{{ bos_token }}"
    "{% if tools %}<|start|>system\nYou may call these tools; write each call as "
    '<tool_call>{"name": ..., "arguments": {...}}</tool_call>.\n<tools>\n'
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools><|end|>\n{% endif %}"
    "{% for message in messages %}"
    "<|start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'tool' %}<tool_response>\n{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% if message['role'] == 'tool' %}\n</tool_response>{% endif %}"
    "{% if message['tool_calls'] is defined and message['tool_calls'] %}"
    "{% for call in message['tool_calls'] %}<tool_call>\n"
    "{\"name\": {{ call['function']['name'] | tojson }}, \"arguments\": "
    "{% if call['function']['arguments'] is string %}{{ call['function']['arguments'] }}"
    "{% else %}{{ call['function']['arguments'] | tojson }}{% endif %}}\n</tool_call>"
    "{% endfor %}{% endif %}"
    "<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant\n{% endif %}"
)

SERVE_ARGS: Final = [
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "hermes",
    "--tool-strict-level",
    "parameter",
]
"""The ``vllm serve`` options this model needs, written beside it (``kvgate-serve-args.json``)
for the worker to apply: the tool-call parser that matches its chat template, and arguments
held to each tool's schema even when the tool is not ``strict`` (random weights would write
anything there; Anthropic's tools carry no ``strict`` flag)."""

_WORDS: Final = [
    "the",
    "a",
    "an",
    "agent",
    "call",
    "session",
    "token",
    "cache",
    "queue",
    "worker",
    "deadline",
    "tier",
    "request",
    "reply",
    "stream",
    "model",
    "batch",
    "prompt",
    "output",
    "input",
    "admit",
    "defer",
    "reject",
    "retry",
    "later",
    "now",
    "fast",
    "slow",
    "full",
    "empty",
    "read",
    "write",
    "plan",
    "build",
    "test",
    "run",
    "stop",
    "start",
    "wait",
    "send",
    "take",
    "give",
    "keep",
    "drop",
    "file",
    "code",
    "line",
    "function",
    "class",
    "value",
    "error",
    "result",
    "list",
    "item",
    "key",
    "map",
    "set",
    "get",
    "put",
    "open",
    "close",
    "load",
    "save",
    "python",
    "rust",
    "json",
    "http",
    "nats",
    "redis",
    "sql",
    "vllm",
    "gpu",
    "cpu",
    "memory",
    "time",
    "second",
    "minute",
    "hour",
    "day",
    "user",
    "system",
    "assistant",
    "tool",
    "think",
    "answer",
    "question",
    "because",
    "when",
    "where",
    "which",
    "while",
    "with",
    "from",
    "into",
    "over",
    "under",
    "after",
    "before",
    "between",
    "again",
    "every",
    "each",
    "some",
    "many",
    "few",
    "more",
    "less",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "zero",
    "hundred",
    "thousand",
    "is",
    "are",
    "was",
    "be",
    "can",
    "will",
    "should",
    "must",
    "may",
    "not",
    "and",
    "or",
    "but",
    "if",
    "then",
    "else",
    "for",
    "in",
    "on",
    "at",
    "to",
    "of",
    "by",
    "as",
    "it",
]


@dataclass(frozen=True)
class DevModelSpec:
    vocab_size: int = 2048
    hidden_size: int = 256
    intermediate_size: int = 512
    num_layers: int = 2
    num_heads: int = 4  # head size 64: vLLM's CPU attention kernels reject smaller heads
    num_kv_heads: int = 2
    max_position_embeddings: int = 2048
    seed: int = 0
    corpus_lines: int = 4000
    template_version: int = 2
    """Raised whenever the chat template, its special tokens or the weight shaping change, so
    old builds rebuild."""

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_heads


def _never_only_whitespace(model: Any, tokenizer: Any) -> None:
    """Make tokens that are nothing but whitespace all but impossible to sample.

    Random weights otherwise fill the optional whitespace that JSON grammars allow (structured
    output, forced tool calls) until ``max_tokens``, where a trained model writes compact JSON.
    How: hidden dimension 0 is a constant 1 in every token embedding and no layer writes to
    it, so after the final norm it is positive at every position; the output rows of the
    whitespace tokens read only that dimension, with a large negative weight."""
    import torch

    whitespace = [
        i for i in range(len(tokenizer)) if (text := tokenizer.decode([i])) and not text.strip()
    ]
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 1.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0, :] = 0.0
            layer.mlp.down_proj.weight[0, :] = 0.0
        model.lm_head.weight[whitespace, :] = 0.0
        model.lm_head.weight[whitespace, 0] = -50.0


def is_built(directory: Path, spec: DevModelSpec | None = None) -> bool:
    """True when ``directory`` holds a complete build of ``spec`` (the default spec if None)."""
    marker = directory / SPEC_FILE
    if not marker.is_file() or not (directory / "config.json").is_file():
        return False
    try:
        recorded = json.loads(marker.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return bool(recorded == asdict(spec or DevModelSpec()))


def _corpus(spec: DevModelSpec) -> list[str]:
    rng = random.Random(spec.seed)
    lines = []
    for _ in range(spec.corpus_lines):
        words = rng.choices(_WORDS, k=rng.randint(4, 16))
        lines.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", ":", ","]))
    return lines


def build(directory: Path, spec: DevModelSpec | None = None) -> Path:
    """Write the model and tokenizer into ``directory`` and return it.

    Imports torch and transformers lazily: only the build and the worker need them.
    """
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    spec = spec or DevModelSpec()
    if spec.hidden_size % spec.num_heads or spec.head_size != 64:
        raise ValueError("the development model needs head size 64 (hidden_size / num_heads)")
    directory.mkdir(parents=True, exist_ok=True)

    specials = ["<unk>", "<s>", "</s>", "<pad>", "<|start|>", "<|end|>", *_TOOL_TOKENS]
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_corpus(spec), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        additional_special_tokens=["<|start|>", "<|end|>", *_TOOL_TOKENS],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_size,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config)
    _never_only_whitespace(model, tokenizer)
    model = model.to(torch.bfloat16)
    model.save_pretrained(directory, safe_serialization=True)
    (directory / SERVE_ARGS_FILE).write_text(json.dumps(SERVE_ARGS))
    (directory / SPEC_FILE).write_text(json.dumps(asdict(spec), indent=2, sort_keys=True))
    return directory
