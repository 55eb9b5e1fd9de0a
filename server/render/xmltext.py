"""User text made safe for the markup graphdeck renders: SVG (XML) and Plotly figure text.

XML 1.0 forbids some characters outright, escaped or not: the C0 controls but tab, newline and
carriage return, the UTF-16 surrogates and U+FFFE / U+FFFF. One of them in a node name, a module
path or a graph name made the whole SVG unreadable ("not well-formed"), so every string from the
store passes :func:`clean` (forbidden characters dropped, long text cut) before it is escaped, and
every finished document :func:`xml_safe` once more.

Plotly draws figure text (trace names, tick labels, titles, hover values substituted into a
``hovertemplate``) as its own pseudo-HTML: ``<a href="https://…">`` in an event name became a
clickable external link. :func:`plotly_text` escapes ``&``, ``<`` and ``>`` (Plotly decodes the
entities back), so such a name is shown as the text it is.
"""

from __future__ import annotations

import re
from html import escape

#: Characters XML 1.0 forbids (and DEL, which prints nothing), dropped from user text.
XML_FORBIDDEN = re.compile("[\x00-\x08\x0b-\x1f\x7f\ud800-\udfff\ufffe\uffff]")
#: Only the forbidden characters (tabs, newlines and carriage returns are kept).
_FORBIDDEN_ONLY = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")
#: User text longer than this is cut in SVG labels.
MAX_TEXT_CHARS = 60


def clean(value: str, *, limit: int = MAX_TEXT_CHARS, newlines: bool = False) -> str:
    """User text made printable and short: control characters and characters XML forbids
    dropped, tabs to spaces, newlines to ``⏎`` unless ``newlines`` (tooltips), long text cut as
    ``…[total_len=N]``. Escaping happens on output."""
    clean_text = XML_FORBIDDEN.sub("", str(value)).replace("\r", "").replace("\t", " ")
    if not newlines:
        clean_text = clean_text.replace("\n", " \u23ce ")
    if len(clean_text) > limit:
        clean_text = f"{clean_text[: limit - 20]}…[total_len={len(clean_text)}]"
    return clean_text


def attr(value: str) -> str:
    """``value`` as an XML attribute value (forbidden characters dropped, quotes escaped)."""
    return escape(XML_FORBIDDEN.sub("", str(value)), quote=True)


def xml_safe(document: str) -> str:
    """``document`` without any character XML forbids (a last guard over a whole SVG)."""
    return _FORBIDDEN_ONLY.sub("", document)


def plotly_text(value: str) -> str:
    """``value`` for Plotly figure text: ``&``, ``<``, ``>`` as entities, so no tag (a link, a
    line break, bold) is made from a user string."""
    return str(value).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
