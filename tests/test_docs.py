"""The docs site says what the code does: every flag and setting is in it, nothing it names is missing
from the code, its commands parse (the cheap ones run), its links resolve, and a browser finds its
navigation and its search.

The reference pages are generated from the code at build time (docs/gen_reference.py), so a flag added to
the parser is in the next build's reference by construction; what can still drift is the hand-written
prose (README.md and docs/**/*.md), which these tests read in the other direction, and a flag added with
no help text, which the reference could only list without saying what it does.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import html
import http.server
import os
import re
import shlex
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
sys.path.insert(0, str(DOCS))

import gen_reference  # noqa: E402  (docs/ is no package: its generator is imported from its folder)

CHROMIUM = Path("/usr/bin/chromium")
ARGS = ["--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"]
ROLLFLOW = [sys.executable, "-m", "rollflow"]
# Pages the generator writes: checked for coverage, not read as hand-written prose.
GENERATED = {DOCS / "benchmarks.md", *(gen_reference.REFERENCE / n for n in ("commands.md", "settings.md"))}
GENERATED |= {gen_reference.REFERENCE / "report.md", gen_reference.REFERENCE / "exit-codes.md"}
# Other tools' flags the prose shows in their own commands (vLLM, Dask, Ray, Prefect, Docker, pip).
FOREIGN_FLAGS = {
    "--port", "--nthreads", "--preload", "--preload-nanny", "--address", "--param", "--params",
    "--pool", "--type", "--all", "--prefect-file", "--background", "--continuous-batching", "--head",
}  # fmt: skip
# Flags `--help` shows today with no help text. An entry here that gains help fails the test below, so
# the set only shrinks; a new flag without help fails it too.
KNOWN_WITHOUT_HELP = {
    ("simulate", "--host"),
    ("simulate", "--seed"),
    ("serve", "--verbose"),
    ("demo", "--verbose"),
}
FLAG = re.compile(r"(?<![\w/.+-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*")
ENV = re.compile(r"\bROLLFLOW_[A-Z0-9_]*[A-Z0-9*]")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def prose_files() -> list[Path]:
    """README.md and every hand-written page under docs/ (generated pages excluded)."""
    pages = [p for p in sorted(DOCS.rglob("*.md")) if p not in GENERATED]
    return [ROOT / "README.md", *pages]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site as `make docs` builds it (generator, then mkdocs --strict), into a temporary folder."""
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    subprocess.run([sys.executable, str(DOCS / "gen_reference.py")], cwd=ROOT, check=True, timeout=120)
    mkdocs = [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(out)]
    done = subprocess.run(mkdocs, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"
    return out


@pytest.fixture(scope="module")
def site_text(site: Path) -> str:
    """Every page's text as a reader sees it (tags removed, entities decoded)."""
    pages = [p.read_text(encoding="utf-8") for p in site.rglob("*.html")]
    return html.unescape(re.sub(r"<[^>]+>", " ", "\n".join(pages)))


def commands() -> list[tuple[str, argparse.ArgumentParser]]:
    return [(name, parser) for name, _, parser in gen_reference.command_parsers()]


def undocumented(flags: list[str], text: str) -> list[str]:
    """The flags a site's text never names (a flag must stand alone, not be the start of a longer one)."""
    return [f for f in flags if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", text)]


# -- (a) every flag and every setting is in the site; the prose names nothing that does not exist ------


def test_every_flag_of_every_command_is_in_the_site(site_text: str) -> None:
    missing = {
        name: undocumented(gen_reference.flag_strings(parser), site_text) for name, parser in commands()
    }
    missing["(top level)"] = undocumented(gen_reference.flag_strings(gen_reference.top_parser()), site_text)
    assert not {k: v for k, v in missing.items() if v}, f"flags missing from the built site: {missing}"


def test_a_flag_added_to_the_parser_is_missing_until_the_site_is_rebuilt(site_text: str) -> None:
    """The check above fails on a flag the built site does not have: a parser with one more flag than the
    one the site was built from, as a flag added without regenerating the reference would be."""
    _, parser = commands()[0]
    parser.add_argument("--brand-new-flag", help="added after the site was built")
    assert undocumented(gen_reference.flag_strings(parser), site_text) == ["--brand-new-flag"]


def test_every_flag_has_help_text() -> None:
    """A flag's help is its documentation: the reference can only list a flag without it."""
    silent = {
        (name, action.option_strings[-1])
        for name, parser in commands()
        for _, actions in gen_reference.shown_actions(parser)
        for action in actions
        if not (action.help or "").strip()
    }
    assert silent <= KNOWN_WITHOUT_HELP, f"flags with no help text: {sorted(silent - KNOWN_WITHOUT_HELP)}"
    assert silent >= KNOWN_WITHOUT_HELP, f"these have help now: {sorted(KNOWN_WITHOUT_HELP - silent)}"
    parser = argparse.ArgumentParser()
    parser.add_argument("--undocumented")
    assert [a.option_strings for _, acts in gen_reference.shown_actions(parser) for a in acts if not a.help]


def test_every_setting_is_in_the_site(site_text: str) -> None:
    missing = [env for env in gen_reference.env_vars() if not _named(env, site_text)]
    assert not missing, f"settings missing from the built site: {missing}"
    # a whole name, never a prefix of a longer one (ROLLFLOW_BACKEND__API_KEY within ..._API_KEY_BLOCK)
    assert not _named("ROLLFLOW_BACKEND__API_KEY", "ROLLFLOW_BACKEND__API_KEY_BLOCK")


def _named(name: str, text: str) -> bool:
    return re.search(rf"(?<![A-Z0-9_]){re.escape(name)}(?![A-Z0-9_])", text) is not None


def test_every_exit_code_is_in_the_site(site_text: str) -> None:
    assert all(_named(name, site_text) for name, _ in gen_reference.exit_codes())


@functools.cache
def code_env_vars() -> set[str]:
    """ROLLFLOW_* names the code reads besides the settings (the benches', the tests', a worker's)."""
    found: set[str] = set()
    for folder in ("flows", "tasks", "settings", "infra", "bench", "tests"):
        for path in (ROOT / folder).rglob("*.py"):
            found |= set(re.findall(r"\bROLLFLOW_[A-Z0-9_]+", path.read_text(encoding="utf-8")))
    return found


def test_the_prose_names_only_flags_and_settings_that_exist() -> None:
    flags = {f for _, parser in commands() for f in gen_reference.flag_strings(parser)}
    flags |= set(gen_reference.flag_strings(gen_reference.top_parser())) | FOREIGN_FLAGS
    settings = set(gen_reference.env_vars()) | code_env_vars()
    wrong: list[str] = []
    for path in prose_files():
        text = path.read_text(encoding="utf-8")
        where = path.relative_to(ROOT)
        wrong += [f"{where}: {f}" for f in sorted(set(FLAG.findall(text)) - flags)]
        for name in sorted(set(ENV.findall(text))):
            stem = name.rstrip("*")
            known = any(s.startswith(stem) for s in settings) if name.endswith("*") else name in settings
            if not known:
                wrong += [f"{where}: {name}"]
    assert not wrong, "named in the docs but not in the code:\n" + "\n".join(wrong)


def test_the_prose_check_catches_a_flag_that_does_not_exist() -> None:
    assert FLAG.findall("rollflow run --num-repeat 4 --input x") == ["--num-repeat", "--input"]
    flags = {f for _, parser in commands() for f in gen_reference.flag_strings(parser)}
    assert "--num-repeat" not in flags


# -- (b) every command block parses; the cheap ones run ------------------------------------------------


def console_commands() -> list[tuple[str, list[str]]]:
    """(where, argv after `rollflow`) for every `$ rollflow ...` line of a ```console block, and every
    `rollflow ...` line of a ```bash or ```sh block (commands shown without a prompt)."""
    found = []
    for path in prose_files():
        text = path.read_text(encoding="utf-8")
        for fence, block in re.findall(r"^```(console|bash|sh)\n(.*?)^```", text, flags=re.S | re.M):
            for line in block.replace("\\\n", " ").splitlines():
                line = line if fence == "console" else "$ " + line.split(" #")[0].strip()
                if not line.startswith("$ "):
                    continue
                words = shlex.split(line[2:])
                while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):  # VAR=value rollflow ...
                    words.pop(0)
                if words and words[0] == "rollflow":
                    found.append((f"{path.relative_to(ROOT)}: {line[:90]}", words[1:]))
    return found


def test_there_are_command_blocks_to_check() -> None:
    commands_seen = {argv[0] for _, argv in console_commands() if argv and not argv[0].startswith("-")}
    assert {"run", "collect", "reverify", "serve", "demo", "ray-workers"} <= commands_seen


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No ROLLFLOW_* variable and no .env: a command is checked as a new user would type it."""
    for name in list(os.environ):
        if name.startswith("ROLLFLOW_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)


@pytest.mark.usefixtures("clean_env")
@pytest.mark.parametrize(("where", "argv"), console_commands(), ids=lambda v: v if isinstance(v, str) else "")
def test_command_block_parses(where: str, argv: list[str]) -> None:
    """Parsed by the real parser, then, for the pipeline's commands, turned into the run's spec by the
    CLI's own `build_spec` (settings validated, NeMo Gym's `+key=value` applied), as `rollflow` would
    before starting anything."""
    from rollflow.flows.cli.main import build_spec, make_parser

    if any(a in ("--help", "-h", "--version") for a in argv):
        return  # run for real below
    command = next(a for a in argv if not a.startswith("-"))
    if command == "simulate":
        from rollflow.infra.simulator.cli import make_parser as simulator_parser

        simulator_parser().parse_args(argv[1:])
        return
    parser = make_parser(command)
    try:
        args, extra = parser.parse_known_args(argv)
    except SystemExit as exc:
        pytest.fail(f"{where}: does not parse (exit {exc.code})")
    if command in ("run", "collect"):
        assert all(re.match(r"^\+\+?[\w.]+=", e) for e in extra), f"{where}: unknown arguments {extra}"
    else:
        assert not extra, f"{where}: unknown arguments {extra}"
    if command in ("run", "collect", "diagnose", "tune"):
        build_spec(args, extra)


def test_the_cheap_commands_run_for_real(site_text: str) -> None:
    """`--help` of the program and of every command, `--version`, and every `--help` in the docs; every
    flag the real `--help` prints is in the built site."""
    argvs = [["--help"], ["--version"], *([name, "--help"] for name, _ in commands())]
    argvs += [argv for _, argv in console_commands() if {"--help", "--version"} & set(argv)]
    missing: dict[str, list[str]] = {}
    wide = {**os.environ, "COLUMNS": "10000"}  # argparse wraps at hyphens: one flag must stay one word
    for argv in argvs:
        done = subprocess.run(
            [*ROLLFLOW, *argv], capture_output=True, text=True, timeout=120, cwd=ROOT, env=wide
        )
        assert done.returncode == 0, f"rollflow {' '.join(argv)}: exit {done.returncode}\n{done.stderr}"
        assert done.stdout.strip(), f"rollflow {' '.join(argv)} printed nothing"
        if "--help" in argv:
            missing[" ".join(argv)] = undocumented(sorted(set(FLAG.findall(done.stdout))), site_text)
    assert not {k: v for k, v in missing.items() if v}, f"--help flags missing from the site: {missing}"


# -- (c) links resolve ---------------------------------------------------------------------------------


def slugs(markdown: str) -> set[str]:
    """The anchors of a Markdown file's headings, as GitHub and MkDocs' toc make them."""
    found = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *$", markdown, flags=re.M):
        text = re.sub(r"[`*_]|<[^>]+>", "", heading).strip().lower()
        found.add(re.sub(r"\s+", "-", re.sub(r"[^\w\s-]", "", text)))
    return found


def test_readme_links_resolve() -> None:
    """Relative links of the README to files that are in the repository (never to a generated page,
    which a clone does not have) and to headings that exist."""
    readme = ROOT / "README.md"
    text = readme.read_text(encoding="utf-8")
    broken = []
    ignored = (ROOT / ".gitignore").read_text(encoding="utf-8")
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        file = (readme.parent / path).resolve() if path else readme
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif any(file.is_relative_to(ROOT / p.strip("/")) for p in ignored.split() if p.startswith("/docs/")):
            broken.append(f"{target}: a generated page, not in a clone")
        elif anchor and anchor not in slugs(file.read_text(encoding="utf-8")):
            broken.append(f"{target}: no heading #{anchor}")
    assert not broken, "README.md links that do not resolve:\n" + "\n".join(broken)
    assert len(text.splitlines()) <= 300, "README.md is at most 300 lines: move the rest into docs/"
    assert "make test" in text, "CI runs `make test` as the README says"


def test_the_site_was_checked_for_links(site: Path) -> None:
    """mkdocs --strict fails on a broken link or anchor (mkdocs.yml's validation); the pages it links
    were all built."""
    config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    assert "strict: true" in config and "anchors: warn" in config
    for page in ("index.html", "reference/commands.html", "reference/settings.html", "benchmarks.html"):
        assert (site / page).exists(), page


# -- (d) a browser finds the navigation and the search -------------------------------------------------


@contextlib.contextmanager
def served(folder: Path) -> Iterator[str]:
    """The built site over HTTP on 127.0.0.1 and a free port, for as long as the block runs."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:  # a page's requests are no test output
            pass

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Quiet, directory=str(folder))
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.mark.skipif(not CHROMIUM.exists(), reason="Debian's chromium is installed by .ci/run")
def test_a_browser_finds_the_navigation_and_the_search(site: Path) -> None:
    from playwright.sync_api import sync_playwright

    with served(site) as url, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=ARGS, timeout=60_000)
        try:
            page = browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
            page.set_default_timeout(30_000)
            page.route(re.compile(r"^(?!http://127\.0\.0\.1)"), lambda route: route.abort())  # loopback only
            for path, heading in (
                ("index.html", "rollflow"),
                ("reference/commands.html", "Commands and flags"),
            ):
                page.goto(f"{url}/{path}", wait_until="load")
                assert page.locator("h1").first.inner_text().strip().startswith(heading)
                nav = page.locator("nav.md-nav--primary")
                nav.first.wait_for(state="visible")
                for section in ("Tutorials", "How-to guides", "Reference", "Troubleshooting", "Concepts"):
                    assert nav.first.get_by_text(section, exact=True).count() >= 1, section
                search = page.locator("input.md-search__input")
                search.wait_for(state="attached")
                page.locator("label.md-search__icon, .md-search__input").first.click()
                search.press_sequentially("parallelism", delay=20)  # Material searches as keys are typed
                result = page.locator(".md-search-result__item").first
                result.wait_for(state="visible")
                assert "parallelism" in page.locator(".md-search-result").inner_text().lower()
                page.keyboard.press("Escape")
        finally:
            browser.close()
