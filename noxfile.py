"""Development sessions; each runs the same command the README shows."""

import nox


nox.options.sessions = ["lint", "tests"]


@nox.session
def tests(session: nox.Session) -> None:
    session.install("-e", ".[tests]")
    session.run("python", "-m", "pytest", "-n", "2", "-q", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", "graphax_eqx")


@nox.session
def typecheck(session: nox.Session) -> None:
    session.install("-e", ".", "pyright>=1.1.380")
    session.run("pyright", "graphax_eqx")


@nox.session
def docs(session: nox.Session) -> None:
    session.install("-e", ".[docs]")
    session.run("mkdocs", "build", "--strict")


@nox.session
def bench(session: nox.Session) -> None:
    session.install("-e", ".[examples]")
    session.run("python", "-m", "benchmarks", *session.posargs)
