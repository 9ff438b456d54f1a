"""app.py's request guard at the ASGI level, without a server or a browser (those are in
``test_app.py``, the browser pass): what it sends for a refused request, and what it reads."""

import asyncio

import app


def test_a_refused_request_is_read_before_the_403():
    """The guard reads a refused upload's body before it answers (so a client still sending
    it gets the 403, not a connection reset under load), at most ``limit`` bytes of it, and
    never passes the request on."""
    def messages(n):
        chunks = [b"x" * 1000] * n
        async def receive():
            return {"type": "http.request", "body": chunks.pop(0), "more_body": len(chunks) > 0}
        return chunks, receive

    async def the_page(scope, receive, send):
        raise AssertionError("a refused request reached the page")

    sent = []
    async def send(message):
        sent.append(message)

    chunks, receive = messages(5)
    scope = {"type": "http", "method": "POST", "path": "/gradio_api/upload", "headers": [(b"host", b"127.0.0.1:7860")]}
    asyncio.run(app.RequestGuard(the_page, "127.0.0.1")(scope, receive, send))
    assert chunks == [] and sent[0]["status"] == 403 and sent[1]["body"] == b"forbidden: this page takes no uploads\n"
    chunks, receive = messages(5)
    asyncio.run(app.RequestGuard.drain(receive, limit=2500))
    assert len(chunks) == 2          # 3,000 bytes read: past the limit, it stops
