"""Conversations -> token ids + loss mask, for any chat template.

What is supervised: the tokens the model itself produces in an assistant turn, i.e. what follows the
generation prompt, up to and including the special token that ends the turn (`<|im_end|>`,
`<|eot_id|>`, ...). Not supervised: system/user turns, the generation prompt, and text the template
writes whatever the message says (role headers, the empty `<think>\\n\\n</think>\\n\\n` that Qwen
templates insert when a turn has no reasoning, the newline after `<|im_end|>`).

How it is found without knowing the template (no `{% generation %}` markers needed), in time linear in
the conversation's length:
1. Render the whole conversation once (`F`); its tokens are what training sees.
2. Render it once more with every assistant message replaced by its own probe (a private-use character
   absent from `F`): `Fp = T0 p1 T1 p2 ... pk Tk`, where the chunks `Tj` are template text and the other
   messages. A turn's own characters in `F` are what lies between the chunks around its probe: the
   first turn starts where `F` stops agreeing with `T0`, the last ends where `F` stops agreeing with `Tk`
   read from the end, and each middle chunk is found verbatim in `F`, searching forward. This is what
   rendering the conversation with only turn i probed and taking the common prefix and suffix with `F`
   gives, whether or not the template is prefix-stable (Qwen3 drops earlier turns' reasoning and writes
   the empty think block only on the last turn). Where a chunk is not verbatim in `F` (the template writes
   different text next to a turn depending on its content, e.g. a think block around reasoning) or could
   sit in two places (a turn's text contains the chunk), the turns next to it are located that way, one
   extra render each. The span is extended over the special token that immediately follows it (the end
   of turn).
3. The model's output is what the template appends after its own generation prompt. For assistant
   turn i, render messages[:i] with the generation prompt (`P`) and messages[:i+1] without it (`Q`):
   `Q` must start with `P`. A sample that breaks this (e.g. reasoning in the data while `data.thinking`
   is false, so the prompt pre-fills an empty think block that the rendered turn does not have) is
   dropped with the reason `generation_prompt_mismatch`. The first and the last turn do exactly this
   (for the last, `Q` is `F`). A turn in the middle renders only its own exchange (from the user message
   before it), which keeps the work linear, and its prompt ends where the generation prompt text `G`
   (what the first turn's `P` adds to its history) ends in `F`.
4. Tokenise `F` in pieces cut where each assistant turn's generation prompt ends (where `F` has the
   prompt; otherwise where the turn's own text starts), as a server tokenises the prompt and then
   appends generated tokens. Inside a piece, the supervised tokens are found by differences of token
   sequences: the piece's tokens minus the common prefix with the tokens of the unsupervised text
   before the span and the common suffix with those of the text after it, so a token that merges
   across a boundary (e.g. ".\\n" in a template without end-of-turn tokens) counts as supervised.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field

ACCEPTED_SCHEMAS = (
    "`messages` (OpenAI: list of {role, content[, reasoning_content]}, roles system/user/assistant)",
    "`conversations` (ShareGPT: list of {from, value}, from system/human/gpt)",
    "`prompt` + `response` (one exchange; optional `system`)",
)
_SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
                   "assistant": "assistant", "chatgpt": "assistant", "model": "assistant"}
_ROLES = ("system", "user", "assistant")
# Private-use characters (Unicode's own and the supplementary plane A): never meaningful in real text.
_PROBE_RANGE = (range(0xE000, 0xF900), range(0xF0000, 0xFFFFE))


class SampleError(Exception):
    """A sample that cannot be used; `reason` is the key counted in the audit report."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def detect_schema(columns, setting: str = "data.path", where: str = "") -> str:
    cols = set(columns)
    if "messages" in cols:
        return "messages"
    if "conversations" in cols:
        return "conversations"
    if {"prompt", "response"} <= cols:
        return "prompt_response"
    raise ValueError(
        f"{setting}: unknown dataset schema{(' in ' + where) if where else ''}: found fields "
        f"{sorted(cols)}; accepted: " + "; ".join(ACCEPTED_SCHEMAS)
        + ". Convert the dataset or point the setting at one in these formats.")


def _text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        parts = [p.get("text") or "" for p in content if isinstance(p, dict) and p.get("type", "text") == "text"]
        return "".join(parts)
    raise SampleError("bad_message", f"content of type {type(content).__name__}")


def record_schema(sample: dict, default: str) -> str:
    """The format this record holds (a file may mix them record by record: the dataset then has the
    fields of every format, None where a record lacks them), else `default`."""
    if isinstance(sample.get("messages"), list):
        return "messages"
    if isinstance(sample.get("conversations"), list):
        return "conversations"
    if sample.get("prompt") is not None and sample.get("response") is not None:
        return "prompt_response"
    return default


def _message(m: dict) -> dict:
    """One message in either style ({role, content} or ShareGPT's {from, value}): a list may mix them."""
    if m.get("role") is not None:
        role = str(m["role"]).lower()
        role = _SHAREGPT_ROLES.get(role, role)
        out = {"role": role, "content": _text(m.get("content"))}
        if isinstance(m.get("reasoning_content"), str) and m["reasoning_content"]:
            out["reasoning_content"] = m["reasoning_content"]
        if role == "assistant" and m.get("truncated") is True:
            # an answer cut at the regeneration budget: its end-of-turn token was never generated
            out["truncated"] = True
    elif m.get("from") is not None:
        role = _SHAREGPT_ROLES.get(str(m["from"]).lower(), str(m["from"]))
        out = {"role": role, "content": _text(m.get("value"))}
    else:
        raise SampleError("bad_message", "a message has neither `role` nor `from`")
    if role not in _ROLES:
        raise SampleError("unknown_role", repr(role))
    return out


def normalize(sample: dict, schema: str) -> list[dict]:
    """One row of the dataset -> list of {role, content[, reasoning_content]} messages. The format is
    the record's own (record_schema); `schema` is the dataset's, used when the record holds none."""
    has_any = any(sample.get(k) is not None for k in ("messages", "conversations", "prompt", "response"))
    schema = record_schema(sample, schema)
    if not has_any:
        raise SampleError("unknown_format", "no messages, conversations or prompt + response")
    if schema == "prompt_response":
        if sample.get("prompt") is None or sample.get("response") is None:
            raise SampleError("bad_message", "prompt or response missing")
        msgs = []
        if sample.get("system"):
            msgs.append({"role": "system", "content": _text(sample["system"])})
        msgs.append({"role": "user", "content": _text(sample["prompt"])})
        msgs.append({"role": "assistant", "content": _text(sample["response"])})
        return msgs
    raw = sample.get(schema)
    if not isinstance(raw, list):
        raise SampleError("bad_message", f"`{schema}` is not a list")
    msgs = []
    for m in raw:
        if not isinstance(m, dict):
            raise SampleError("bad_message", "message is not an object")
        msgs.append(_message(m))
    return msgs


@dataclass
class Encoded:
    input_ids: list[int]
    loss_mask: list[int]
    turn_spans: list[tuple[int, int]] = field(default_factory=list)  # supervised token ranges
    probe_located_turns: int = 0  # turns whose generation prompt is not a prefix of the full render


def _common_prefix(a, b) -> int:
    # Binary search on slice equality: C-speed comparisons on long rendered conversations.
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _common_suffix(a, b, limit: int) -> int:
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[len(a) - mid:] == b[len(b) - mid:]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class ChatEncoder:
    """Renders conversations with a tokenizer's chat template and computes assistant loss masks."""

    def __init__(self, tokenizer, thinking: bool, tokenizer_setting: str = "target.path"):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"{tokenizer_setting}: the tokenizer has no chat template (tokenizer_config.json "
                "`chat_template` or chat_template.jinja); use a chat/instruct checkpoint or add one")
        self.tokenizer = tokenizer
        self.thinking = bool(thinking)
        specials = set(getattr(tokenizer, "all_special_tokens", []) or [])
        for tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
            if getattr(tok, "special", False):
                specials.add(str(tok))
        # Longest first so that a token that is a prefix of another does not win.
        self.special_strings = sorted((s for s in specials if s), key=len, reverse=True)

    def render(self, messages: list[dict], generation_prompt: bool) -> str:
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt,
                enable_thinking=self.thinking)
        except Exception as e:  # jinja raise_exception, missing fields, role order rules
            raise SampleError("template_error", f"{type(e).__name__}: {e}") from e
        assert isinstance(text, str), type(text)
        return text

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        return self.tokenizer(texts, add_special_tokens=False)["input_ids"]

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """Token ids of `messages` followed by the generation prompt (what a server would see)."""
        return self.tokenize([self.render(messages, True)])[0]

    def _probes(self, text: str, n: int) -> list[str]:
        used = set(text)
        probes = list(itertools.islice((c for c in map(chr, itertools.chain(*_PROBE_RANGE)) if c not in used), n))
        if len(probes) < n:
            raise SampleError("template_error", "too many assistant turns to probe")
        return probes

    def _extend(self, full: str, end: int) -> int:
        for s in self.special_strings:  # the end-of-turn token is the model's output too
            if full.startswith(s, end):
                return end + len(s)
        return end

    def _turn_span(self, messages: list[dict], i: int, full: str) -> tuple[int, int]:
        """Span of assistant message i alone: render with it probed, common prefix and suffix with `full`."""
        probe = self._probes(full, 1)[0]
        probed = self.render(messages[:i] + [{"role": "assistant", "content": probe}] + messages[i + 1:], False)
        start = _common_prefix(full, probed)
        end = len(full) - _common_suffix(full, probed, min(len(full), len(probed)) - start)
        return start, end if messages[i].get("truncated") else self._extend(full, end)

    def _spans(self, messages: list[dict], turns: list[int], full: str) -> list[tuple[int, int]]:
        """Character spans of all assistant turns from one probe render (module docstring, step 2)."""
        k = len(turns)
        probes = self._probes(full, k)
        probed = list(messages)
        for i, p in zip(turns, probes):
            probed[i] = {"role": "assistant", "content": p}
        starts: list = [None] * k
        ends: list = [None] * k
        try:
            fp = self.render(probed, False)
            pattern = re.compile("[" + "".join(re.escape(p) for p in probes) + "]")
            where = [(m.start(), m.group()) for m in pattern.finditer(fp)]
        except SampleError:
            where = []
        if [p for _, p in where] == probes:  # each probe exactly once, in order
            cut = [-1] + [w for w, _ in where] + [len(fp)]
            chunks = [fp[cut[j] + 1:cut[j + 1]] for j in range(k + 1)]
            starts[0] = _common_prefix(full, chunks[0])
            ends[-1] = len(full) - _common_suffix(full, chunks[-1], min(len(chunks[-1]), len(full) - starts[0]))
            found = {}  # middle chunk j -> its position in full
            lo = starts[0]
            for j in range(1, k):
                x = full.find(chunks[j], lo, ends[-1]) if chunks[j] else -1
                if x >= 0:
                    found[j] = x
                    lo = x + len(chunks[j])
            located = sorted(found)
            for n, j in enumerate(located):
                # Ambiguous when the chunk occurs again before the next located chunk ends: the turn's
                # own text may contain it.
                nxt = located[n + 1] if n + 1 < len(located) else None
                bound = found[nxt] + len(chunks[nxt]) if nxt is not None else ends[-1]
                if full.find(chunks[j], found[j] + 1, bound) < 0:
                    ends[j - 1], starts[j] = found[j], found[j] + len(chunks[j])
        spans = []
        for t, i in enumerate(turns):
            if starts[t] is None or ends[t] is None or ends[t] < starts[t]:
                spans.append(self._turn_span(messages, i, full))
            else:
                # a truncated answer (cut at the regeneration budget) does not own the end-of-turn
                # token the template renders after it: the target never produced it
                spans.append((starts[t], ends[t] if messages[i].get("truncated") else self._extend(full, ends[t])))
        return spans

    def encode(self, messages: list[dict]) -> Encoded:
        last = max((k for k, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
        if last < 0:
            raise SampleError("no_assistant_turn")
        messages = messages[:last + 1]  # trailing user turns are context for nothing
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        full = self.render(messages, False)
        spans, cuts, probe_located = [], [], 0
        gen = None  # the generation prompt text (what it adds to the history), from the first turn
        exchange = 0  # index of the last user message before the current turn
        for t, ((start, end), i) in enumerate(zip(self._spans(messages, turns, full), turns)):
            if spans and start < spans[-1][1]:
                raise SampleError("template_error", "assistant turns overlap in the rendered text")
            exchange = max([exchange] + [u for u in range(turns[t - 1] if t else 0, i)
                                         if messages[u]["role"] == "user"])
            if t == 0 or t == len(turns) - 1 or gen is None:
                prompt = self.render(messages[:i], True)
                q = full if t == len(turns) - 1 else self.render(messages[:i + 1], False)
                if not q.startswith(prompt):
                    raise SampleError("generation_prompt_mismatch", f"assistant turn {i}")
                cut = len(prompt) if full.startswith(prompt) and len(prompt) <= start else -1
                if t == 0 and len(turns) > 2:
                    history = self.render(messages[:i], False)
                    gen = prompt[len(history):] if prompt.startswith(history) else None
            else:
                # A middle turn: checked as the last turn of its own exchange (a window from the user
                # message before it, not the whole history: linear), cut where the generation prompt
                # text ends in F.
                window = self.render(messages[exchange:i], True)
                if not self.render(messages[exchange:i + 1], False).startswith(window):
                    raise SampleError("generation_prompt_mismatch", f"assistant turn {i}")
                x = full.rfind(gen, spans[-1][1], start)
                cut = x + len(gen) if x >= 0 else -1
            if cut < 0:
                cut, probe_located = start, probe_located + 1
            if cuts and cut < spans[-1][1]:
                cut = start
            spans.append((start, end))
            cuts.append(cut)
        texts = [full[:cuts[0]]]
        bounds = cuts[1:] + [len(full)]
        for (start, end), cut, stop in zip(spans, cuts, bounds):
            texts += [full[cut:stop], full[cut:start], full[end:stop]]
        toks = self.tokenize(texts)  # one call for the whole conversation
        ids = list(toks[0]) if cuts[0] > 0 else []
        mask, turn_spans = [0] * len(ids), []
        for t in range(len(spans)):
            piece, lead, tail = toks[1 + 3 * t:4 + 3 * t]
            a = _common_prefix(piece, lead)
            b = _common_suffix(piece, tail, min(len(tail), len(piece) - a))
            turn_spans.append((len(ids) + a, len(ids) + len(piece) - b))
            ids += piece
            mask += [0] * a + [1] * (len(piece) - a - b) + [0] * b
        return Encoded(ids, mask, turn_spans, probe_located)
