"""The model's prediction for one text, and the query row whose attention explains it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from probe.hooks.capture import capture_attention
from probe.models.core import encode_texts
from probe.models.text import forward_inputs

if TYPE_CHECKING:
    from probe.models.core import ProbeModel


def _label_name(pm: ProbeModel, index: int) -> str:
    id2label = getattr(pm.model.config, "id2label", None) or {}
    return str(id2label.get(index, id2label.get(str(index), index)))


def target_attention(pm: ProbeModel, text: str, *, strict_length: bool = False, max_new_tokens: int = 20) -> dict:
    """Predict ``text`` and capture the target query's attention row over the input tokens.

    Target query: [CLS] (position 0) for classifiers, the last token for causal LMs, and for
    seq2seq the decoder's last position reading the encoder (cross-attention) after greedy decoding.
    Returns tokens, token ids, the prediction and attention ``[layer, head, key]`` (fp32 tensor).
    """
    batch = encode_texts(pm, [text], strict_length=strict_length)
    ids = batch["input_ids"][0].tolist()
    tokens = pm.tokenizer.convert_ids_to_tokens(ids)
    prediction: dict[str, Any]  # each kind of model its own keys and values
    with torch.no_grad():
        if pm.task.encoder_decoder:
            generated = pm.model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False)
            decoder = {"input_ids": generated, "attention_mask": torch.ones_like(generated)}
            inputs = {**batch, "decoder_input_ids": generated, "decoder_attention_mask": decoder["attention_mask"]}
            with capture_attention(pm, queries="last", stacks=("cross",), attention_mask=batch["attention_mask"],
                                   decoder_attention_mask=decoder["attention_mask"]) as cap:
                pm.model(**inputs)
            maps = cap.maps("cross")
            prediction = {"kind": "seq2seq", "output": pm.tokenizer.decode(generated[0], skip_special_tokens=True)}
        else:
            inputs = forward_inputs(pm, batch)
            queries = "first" if pm.task.labels else "last"
            with capture_attention(pm, queries=queries, stacks=(pm.contract.primary_stack,),
                                   attention_mask=batch["attention_mask"]) as cap:
                out = pm.model(**inputs)
            maps = cap.maps()
            if pm.task.labels:
                probs = torch.softmax(out.logits[0].float(), dim=-1)
                label = int(probs.argmax())
                prediction = {"kind": "classification", "label": _label_name(pm, label), "label_id": label,
                              "probability": float(probs[label]),
                              "probabilities": {_label_name(pm, i): float(p) for i, p in enumerate(probs)}}
            else:
                probs = torch.softmax(out.logits[0, len(ids) - 1].float(), dim=-1)
                top = torch.topk(probs, 5)
                prediction = {"kind": "causal_lm", "next_token": pm.tokenizer.decode([int(top.indices[0])]),
                              "probability": float(top.values[0]),
                              "top": [{"token": pm.tokenizer.decode([int(i)]), "probability": float(p)}
                                      for p, i in zip(top.values, top.indices)]}
    return {
        "tokens": tokens,
        "token_ids": ids,
        "prediction": prediction,
        "query_position": int(maps.query_index[0, 0]),
        "stack": maps.stack,
        "attention": maps.weights[0, :, :, 0, : len(ids)],  # [layer, head, key]
    }
