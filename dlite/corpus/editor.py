"""The file editor tool SWE-agent and OpenHands give their agents (`str_replace_editor`:
view / create / str_replace), run for real on a `dlite.corpus.workspace.Workspace`.

Like the real tool it is a small program over the files: `view` numbers lines as
`cat -n` does (6-wide, a tab), a directory view lists two levels with `find`, and
`str_replace` refuses an `old_str` that is absent or not unique, else rewrites the file
and shows the edited region. Every output is read back from the files on disk, so line
numbers are the file's own.
"""

from dlite.corpus.workspace import ROOT, Workspace

SNIPPET = 4  # lines of context the tool shows around an edit
CLIP = 16_000  # a view longer than this is cut, as the tool cuts it
CLIPPED = ("<response clipped><NOTE>To save on context only part of this file has been shown "
           "to you. You should retry this tool after you have searched inside the file with "
           "`grep -n` in order to find the line numbers of what you are looking for.</NOTE>")


def numbered(lines, start: int) -> str:
    """`cat -n` of `lines`, the first numbered `start` (1-based)."""
    return "\n".join(f"{i:6d}\t{ln}" for i, ln in enumerate(lines, start))


def view(ws: Workspace, rel: str, view_range=None) -> str:
    if ws.path(rel).is_dir():
        _, out = ws.sh(f"find {ROOT}/{rel} -maxdepth 2 -not -path '*/.*' | sort")
        return (f"Here's the files and directories up to 2 levels deep in {ROOT}/{rel}, "
                f"excluding hidden items:\n{out}")
    lines = ws.read_lines(rel)
    a, b = view_range if view_range else (1, len(lines))
    body = numbered(lines[a - 1:b], a)
    if len(body) > CLIP:
        body = body[:CLIP] + CLIPPED
    return f"Here's the result of running `cat -n` on {ROOT}/{rel}:\n{body}"


def create(ws: Workspace, rel: str, text: str) -> str:
    ws.path(rel).parent.mkdir(parents=True, exist_ok=True)
    ws.path(rel).write_text(text, encoding="utf-8")
    return f"File created successfully at: {ROOT}/{rel}"


def str_replace(ws: Workspace, rel: str, old: str, new: str) -> str:
    text = ws.path(rel).read_text(encoding="utf-8")
    n = text.count(old)
    if n == 0:
        return (f"No replacement was performed, old_str `{old}` did not appear verbatim in "
                f"{ROOT}/{rel}.")
    if n > 1:
        starts = [i + 1 for i, ln in enumerate(text.split("\n")) if old.split("\n")[0] in ln]
        return (f"No replacement was performed. Multiple occurrences of old_str `{old}` in "
                f"lines {starts}. Please ensure it is unique")
    at = text[:text.index(old)].count("\n")
    ws.path(rel).write_text(text.replace(old, new), encoding="utf-8")
    lines = ws.read_lines(rel)
    a = max(0, at - SNIPPET)
    b = min(len(lines), at + new.count("\n") + 1 + SNIPPET)
    return (f"The file {ROOT}/{rel} has been edited. Here's the result of running `cat -n` on a "
            f"snippet of {ROOT}/{rel}:\n{numbered(lines[a:b], a + 1)}\nReview the changes and "
            "make sure they are as expected. Edit the file again if necessary.")
