"""The per-turn probe encoder (quadratic in the number of turns), kept as the reference that the
single-pass `ChatEncoder.encode` must agree with: for assistant turn i it renders the conversation
with that one message replaced by a probe, messages[:i] with the generation prompt and messages[:i+1]
without it."""

from dflash_ds.data.chat import Encoded, SampleError, _common_prefix, _common_suffix


def encode_reference(encoder, messages):
    last = max((k for k, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
    if last < 0:
        raise SampleError("no_assistant_turn")
    messages = messages[:last + 1]
    full = encoder.render(messages, False)
    spans, cuts, probe_located = [], [], 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = encoder.render(messages[:i], True)
        if not encoder.render(messages[:i + 1], False).startswith(prompt):
            raise SampleError("generation_prompt_mismatch", f"assistant turn {i}")
        start, end = encoder._turn_span(messages, i, full)
        if spans and start < spans[-1][1]:
            raise SampleError("template_error", "assistant turns overlap in the rendered text")
        if full.startswith(prompt) and len(prompt) <= start:
            cut = len(prompt)
        else:
            cut, probe_located = start, probe_located + 1
        if cuts and cut < spans[-1][1]:
            cut = start
        spans.append((start, end))
        cuts.append(cut)
    ids, mask, turn_spans = [], [], []
    head = encoder.tokenize([full[:cuts[0]]])[0] if cuts[0] > 0 else []
    ids += head
    mask += [0] * len(head)
    bounds = cuts[1:] + [len(full)]
    for (start, end), cut, stop in zip(spans, cuts, bounds):
        piece, lead, tail = encoder.tokenize([full[cut:stop], full[cut:start], full[end:stop]])
        a = _common_prefix(piece, lead)
        b = _common_suffix(piece, tail, min(len(tail), len(piece) - a))
        turn_spans.append((len(ids) + a, len(ids) + len(piece) - b))
        ids += piece
        mask += [0] * a + [1] * (len(piece) - a - b) + [0] * b
    return Encoded(ids, mask, turn_spans, probe_located)
