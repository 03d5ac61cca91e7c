"""The lab target's tokenizer: a byte-level BPE trained on the training split, with a Qwen3-style chat
template and the drafter's mask token inside the vocabulary.

Markup tokens take the first ids (`<|mask|>` is MASK_ID, the lab recipes' `drafter.mask_token_id`;
`<|im_end|>` ends a turn and is the end-of-sequence id), then the 256 byte symbols, then the merges.
Training is deterministic: the same documents in the same order give the same vocabulary and merges.
"""

from __future__ import annotations

import json
import re

PAD, IM_START, IM_END, THINK, END_THINK, MASK = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|mask|>")
MARKUP = (PAD, IM_START, IM_END, THINK, END_THINK, MASK)
MASK_ID = MARKUP.index(MASK)
MAX_LENGTH = 131072  # as Qwen3's: no truncation warning on whole documents

# Qwen3's layout: a system prompt first, reasoning kept only on assistant turns after the last user
# turn (the last one always carries a <think> block, empty without reasoning), and
# `enable_thinking=false` pre-fills an empty <think> block in the generation prompt.
CHAT_TEMPLATE = (
    "{%- if messages and messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}"
    "{%- set content = m.content if m.content is string else '' %}"
    "{%- set reasoning = '' %}"
    "{%- if m.reasoning_content is string %}{%- set reasoning = m.reasoning_content %}"
    "{%- elif '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1] %}"
    "{%- set content = content.split('</think>')[-1] %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_user and (loop.last or reasoning) %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>assistant\\n' + content.lstrip('\\n') + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

# Qwen2/3's pre-tokenisation family (letters, single digits, punctuation runs, newline runs), so token
# boundaries behave like a real target's; indentation runs stay whole, which code needs.
PRETOKENIZE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def train_tokenizer(texts, vocab_size: int):
    """A transformers fast tokenizer trained on `texts` (an iterable of strings, read once, in order)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from tokenizers import processors, trainers

    if vocab_size < len(MARKUP) + 256 + 1:
        raise ValueError(f"lab tokenizer: vocab_size {vocab_size} leaves no room for merges (markup + 256 bytes)")
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  special_tokens=[AddedToken(s, special=True, normalized=False) for s in MARKUP],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    markup = re.compile("|".join(re.escape(s) for s in MARKUP))  # no merges are spent on markup strings
    tok.train_from_iterator((p for t in texts for p in markup.split(t) if p), trainer=trainer)
    # As in Qwen3, the reasoning delimiters are added tokens that decoding keeps (not "special").
    spec = json.loads(tok.to_str())
    for added in spec["added_tokens"]:
        added["special"] = added["content"] not in (THINK, END_THINK)
    return wrap(Tokenizer.from_str(json.dumps(spec)))


def wrap(tok):
    from transformers import PreTrainedTokenizerFast

    ids = [tok.token_to_id(s) for s in MARKUP]
    if ids != list(range(len(MARKUP))):
        raise ValueError(f"lab tokenizer: markup ids {ids}, expected 0..{len(MARKUP) - 1}")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=IM_END, pad_token=PAD,
                                   extra_special_tokens=[IM_START, MASK], model_max_length=MAX_LENGTH,
                                   clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tokenizer_texts(docs: list[dict], max_chars: int):
    """The training split's documents, in corpus order, up to `max_chars` characters in all, plus a few
    rendered turns so that the template's layout gets merges."""
    total = 0
    for d in docs:
        if d["split"] != "train":
            continue
        if total >= max_chars:
            break
        total += len(d["text"])
        yield d["text"]
    for _ in range(64):
        yield f"{IM_START}user\nExplain this.{IM_END}\n{IM_START}assistant\n{THINK}\n\n{END_THINK}\n\nSure.{IM_END}\n"


def save(tokenizer, out) -> None:
    tokenizer.save_pretrained(out)


def load(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
