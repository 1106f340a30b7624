"""Replaces PyInstaller's own pygments hook, which bundles every lexer, formatter and style.

Those are loaded by name at run time, only to highlight code: rich does that for tracebacks
and ``Syntax`` renderables, which blipmq never shows (typer's pretty exceptions are off).
typer imports ``rich.markdown``, hence pygments' core, which the import graph finds alone.
That keeps about 4 MB of lexer sources (over 1 MB in the executable) out.
"""

hiddenimports: list[str] = []
