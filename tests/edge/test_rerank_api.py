"""POST /v1/rerank's body and answer, and what an embedding model served on its own says about itself."""

import types

import numpy as np
import pytest

from contracts.messages import EmbedDone, WorkerStatus
from edge.api.fields import ApiError
from edge.http.embeddings import _ranked, generation_refused, model_facts, parse_rerank

DOCS = ["a", "b", "c"]


def test_a_rerank_body_becomes_a_query_and_its_documents():
    parsed = parse_rerank({"model": "m", "query": "q", "documents": ["a", {"text": "b"}], "top_n": 9, "priority": 2})
    assert parsed.request.kind == "rerank" and parsed.request.embed_texts == ("q", "a", "b")
    assert parsed.documents == ("a", "b") and parsed.top_n == 2 and not parsed.return_documents
    assert parsed.request.priority == 2 and parsed.request.user_text == "q\na\nb"  # what the filters read


@pytest.mark.parametrize("fields, param", [
    ({"query": ""}, "query"), ({"query": 3}, "query"), ({"documents": []}, "documents"),
    ({"documents": ["a", 7]}, "documents[1]"), ({"documents": [{"text": ""}]}, "documents[0].text"),
    ({"top_n": 0}, "top_n"), ({"return_documents": "yes"}, "return_documents")])
def test_bad_rerank_bodies_name_their_field(fields, param):
    with pytest.raises(ApiError) as caught:
        parse_rerank({"model": "m", "query": "q", "documents": ["a"], **fields})
    assert caught.value.status == 400 and caught.value.param == param


def test_results_are_sorted_cut_to_top_n_and_carry_documents_when_asked():
    done = EmbedDone("r", 1, np.array([0.5, 2.0, 0.5], dtype="<f4").tobytes(), (3, 4, 5))
    parsed = parse_rerank({"model": "m", "query": "q", "documents": DOCS, "top_n": 2, "return_documents": True})
    body = _ranked(done, parsed, "m", {"prompt_tokens": 12, "total_tokens": 12})
    assert [(r["index"], r["relevance_score"]) for r in body["results"]] == [(1, 2.0), (0, 0.5)]  # ties: in order
    assert [r["document"]["text"] for r in body["results"]] == ["b", "a"] and body["usage"]["prompt_tokens"] == 12
    plain = _ranked(done, parse_rerank({"model": "m", "query": "q", "documents": DOCS}), "m",
                    {"prompt_tokens": 12, "total_tokens": 12})
    assert len(plain["results"]) == 3 and "document" not in plain["results"][0]


def _gateway(pooling: str | None, embedding_only: bool = True):
    status = None if pooling is None else WorkerStatus("w", "sha256:x", 512, "", 100, False, 64, pooling)
    return types.SimpleNamespace(embedding_only=embedding_only, model_name="tiny",
                                 pool=types.SimpleNamespace(embedding=status))


def test_an_embedding_model_says_what_it_serves():
    assert model_facts(_gateway("mean")) == {"task": "embedding", "pooling": "mean", "dimensions": 64}
    assert model_facts(_gateway("rank")) == {"task": "rerank", "pooling": "rank", "dimensions": None}
    assert model_facts(_gateway("mean", embedding_only=False)) == {}  # a generator's card stays as it was
    err = generation_refused(_gateway("rank"), "/v1/chat/completions")
    assert err.status == 400 and err.param == "model" and err.code == "model_not_supported"
    assert "tiny is an embedding model" in err.message and "/v1/rerank" in err.message
    assert "/v1/embeddings" in generation_refused(_gateway("mean"), "/v1/completions").message
