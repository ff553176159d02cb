"""Bokeh documents belong to the server's IOLoop thread: other threads (the program's,
the prompt's) hand their changes over here."""
from __future__ import annotations


def on_doc_thread(doc, fn, *args) -> None:
    """Run FN(*ARGS) on DOC's IOLoop: the only way other threads touch a Bokeh document.
    A page that went away in the meantime is not an error."""
    try:
        doc.add_next_tick_callback(lambda: fn(*args))
    except Exception:  # noqa: BLE001 - the page went away
        pass
