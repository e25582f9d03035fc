"""Stop strings as the OpenAI API returns them: *without* the stop string.

:meth:`xcosd.nodes.EdgeNode.stream` stops a generation once its text contains a
stop string and returns the text up to and including it (transformers'
convention). The OpenAI API leaves the stop string out, and a streaming client
must never see a piece of it either, even one that arrives before it is known to
be a stop string. :class:`StopTrim` holds back, while the text streams, the
longest tail that could still grow into a stop string, and at the end drops the
stop string the generation ended on.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopTrim:
    """Feed pieces as they stream (:meth:`feed` returns what may be shown now);
    :meth:`finish` returns the rest, without the stop string the text ends with."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.text = ""
        self._shown = 0

    def _held(self) -> int:
        """Characters at the end of the text that are a prefix of a stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s), len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best

    def feed(self, piece: str) -> str:
        self.text += piece
        upto = len(self.text) - self._held()
        out = self.text[self._shown:upto] if upto > self._shown else ""
        self._shown = max(self._shown, upto)
        return out

    def finish(self, stopped: bool) -> str:
        """The text not shown yet; ``stopped``: the generation ended with
        finish reason ``"stop"`` (a stop string at the very end is then cut)."""
        end = len(self.text)
        if stopped:
            for s in self.stops:
                if self.text.endswith(s):
                    end = len(self.text) - len(s)
                    break
        out = self.text[self._shown:end] if end > self._shown else ""
        self._shown = max(self._shown, end)
        return out

    @property
    def shown(self) -> str:
        """Everything :meth:`feed` and :meth:`finish` returned, in order."""
        return self.text[:self._shown]
