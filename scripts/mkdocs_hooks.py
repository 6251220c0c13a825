"""mkdocs hooks (mkdocs.yml): the docs' links to files outside docs/, for the site.

The pages link to ``../README.md`` and ``../CHANGELOG.md`` as GitHub reads them; the site has no
such pages, so mkdocs would report them missing (and fail ``--strict``). Each such link becomes its
text and the file's path in the repository, once the file is found to exist: a link to a file that
is gone still fails the build.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError

LINK = re.compile(r"\[(?P<text>[^\]]*)\]\((?P<target>[^)\s]+)\)")


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    docs = Path(config["docs_dir"]).resolve()
    repo = docs.parent
    here = Path(page.file.abs_src_path).parent

    def outside_docs(match: re.Match[str]) -> str:
        target = match.group("target")
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            return match.group(0)
        resolved = (here / target.partition("#")[0]).resolve()
        if resolved.is_relative_to(docs):
            return match.group(0)
        if not resolved.is_relative_to(repo) or not resolved.exists():
            raise PluginError(f"{page.file.src_uri} links to {target}, which is no file of the repository")
        return f"{match.group('text')} (`{resolved.relative_to(repo)}` in the repository)"

    return LINK.sub(outside_docs, markdown)
