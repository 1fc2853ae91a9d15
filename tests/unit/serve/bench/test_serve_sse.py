"""SSE parsing edge cases and token counting: empty chunks, usage, [DONE], malformed lines, errors."""

from __future__ import annotations

import json

from gpufleet.serve.bench.client import RequestRecord, count_tokens
from gpufleet.serve.bench.sse import StreamState


def chunk(content=None, finish=None, text=None, usage=None, choices=True):
    obj: dict = {"choices": []}
    if choices:
        ch: dict = {"index": 0, "finish_reason": finish}
        if text is not None:
            ch["text"] = text
        else:
            ch["delta"] = {} if content is None else {"content": content}
        obj["choices"] = [ch]
    if usage is not None:
        obj["usage"] = usage
    return b"data: " + json.dumps(obj).encode()


def feed(lines):
    st = StreamState()
    for t, line in enumerate(lines):
        st.feed(line, float(t))
        st.feed(b"", float(t))
    st.close()
    return st


def test_empty_chunks_are_not_tokens_and_usage_is_read():
    st = feed(
        [
            chunk(""),
            chunk("Hel"),
            chunk(""),
            chunk(None),
            chunk("lo", finish="stop"),
            chunk(choices=False, usage={"prompt_tokens": 3, "completion_tokens": 4}),
            b"data: [DONE]",
        ]
    )
    assert st.content_times == [1.0, 4.0] and "".join(st.parts) == "Hello"
    assert st.done and st.finish_reason == "stop" and st.error is None
    rec = RequestRecord(0, 0.0, output_tokens_asked=10)
    count_tokens(rec, st, None)
    assert (rec.output_tokens, rec.prompt_tokens, rec.token_source) == (4, 3, "usage")


def test_completions_text_and_crlf_and_comments():
    st = StreamState()
    st.feed(b": keep-alive\r\n", 0.0)
    st.feed(b"event: message\r\n", 0.0)
    st.feed(chunk(text="ab") + b"\r\n", 1.0)
    st.feed(b"\r\n", 1.0)
    st.feed(b"data:" + chunk(text="c", finish="length")[6:], 2.0)  # no space after the colon
    st.feed(b"\n", 2.0)
    st.close()  # no [DONE]: finish_reason is enough
    assert st.content_times == [1.0, 2.0] and st.finish_reason == "length" and st.error is None


def test_last_event_without_blank_line_is_dispatched_on_close():
    st = StreamState()
    st.feed(chunk("x"), 5.0)
    st.close()
    assert st.content_times == [5.0]


def test_malformed_lines():
    assert feed([b"data: {not json"]).error[0] == "malformed_sse"
    assert feed([b"data: [1, 2]"]).error[0] == "malformed_sse"
    assert feed([b"<html>oops</html>"]).error[0] == "malformed_sse"
    assert feed([chunk("a"), b"data: \xff\xfe"]).error[0] == "malformed_sse"
    st = feed([chunk("a"), b"data: [DONE]", b"garbage after done"])
    assert st.error is None and st.done


def test_error_object_mid_stream():
    st = feed([chunk("a"), b'data: {"error": {"message": "context overflow", "code": 400}}', chunk("b")])
    assert st.error == ("stream_error", "context overflow")
    assert st.content_times == [0.0]  # nothing counted after the error


def test_reasoning_content_counts_as_output():
    st = feed([b'data: {"choices":[{"delta":{"reasoning_content":"think"}}]}', chunk("ok", finish="stop")])
    assert len(st.content_times) == 2


def test_token_sources_without_usage():
    st = feed([chunk("a" * 40, finish="length")])
    rec = RequestRecord(0, 0.0, output_tokens_asked=17)
    count_tokens(rec, st, None)
    assert (rec.output_tokens, rec.token_source) == (17, "max_tokens")
    st = feed([chunk("a" * 40, finish="stop")])
    count_tokens(rec, st, None)
    assert (rec.output_tokens, rec.token_source) == (10, "estimate")

    class Words:
        def count(self, text: str) -> int:
            return len(text.split())

    st = feed([chunk("one two "), chunk("three", finish="stop")])
    count_tokens(rec, st, Words())
    assert (rec.output_tokens, rec.token_source) == (3, "tokenizer")
