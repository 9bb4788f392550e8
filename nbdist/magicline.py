"""A magic line's trailing ``# comment``, cut off as a POSIX shell cuts one.

IPython hands a line magic everything after its name, comment included
(ipython/ipython#7840), so ``%dist_push lr  # send`` would push a variable named ``#``.
Every nbdist magic passes its line through :func:`strip_comment` first. A ``#`` starts a
comment only where a shell's would: at the start of a word, outside quotes. So
``--env KEY=a#b``, ``'#1'``, ``"a # b"`` and ``a\\ #b`` keep theirs, as in bash.
"""

from __future__ import annotations

#: What separates words, as for ``shlex`` and IPython's ``arg_split``.
_BLANKS = " \t\r\n"


def strip_comment(line: str) -> str:
    """``line`` without its trailing comment (and the blanks before it).

    A quote left open keeps the rest of the line, comment signs included: the parser then
    says what is wrong with it, as it did before comments were allowed.
    """
    quote = ""  # the open quote, or ""
    escaped = False
    word_start = True  # the next character starts a word
    for i, char in enumerate(line):
        if escaped:
            escaped, word_start = False, False
        elif quote:
            if char == quote:
                quote = ""
            elif char == "\\" and quote == '"':
                escaped = True
        elif char == "\\":
            escaped, word_start = True, False
        elif char in "'\"":
            quote, word_start = char, False
        elif char in _BLANKS:
            word_start = True
        elif char == "#" and word_start:
            return line[:i].rstrip(_BLANKS)
        else:
            word_start = False
    return line
