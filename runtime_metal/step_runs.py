"""A run of decode steps as a generator of tokens, and what can be sent into one (no heavy imports: every engine,
onnxruntime's included, reads it).

A run (StepQueue.run, Session.decode_from, Engine.start / continue_from) yields tokens; closed early, the engine
stands after the last token yielded. FINISH sent in for a token (generator.send): a pipelined loop, which queued
the next step before reading this token, yields that next token and ends, queuing no more (a speculative loop that
stops a plain run for a drafting step uses that step instead of throwing it away); an engine that runs one step at
a time has nothing queued and ends at once.
"""

from __future__ import annotations

FINISH = "finish"


def relay(steps, each=None):
    """`steps`' items, each handed to `each` first, with what is sent in (FINISH) passed on to `steps`; closing
    this closes `steps`."""
    sent = None
    try:
        while True:
            try:
                item = steps.send(sent)
            except StopIteration:
                return
            if each is not None:
                each(item)
            sent = yield item
    finally:
        steps.close()
