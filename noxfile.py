"""Development sessions; each runs the same command the README shows."""

import nox


nox.options.sessions = ["lint", "typecheck", "tests"]


@nox.session
def tests(session: nox.Session) -> None:
    session.install("-e", ".[tests]")
    session.run("python", "-m", "pytest", "-n", "2", "-q", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    # The `dev` extra pins the exact tool versions.
    session.install("-e", ".[dev]")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    session.install("-e", ".[dev]")
    session.run("pyright", "graphax_eqx")


@nox.session
def docs(session: nox.Session) -> None:
    session.install("-e", ".[docs]")
    session.run("mkdocs", "build", "--strict")


@nox.session
def bench(session: nox.Session) -> None:
    session.install("-e", ".[examples]")
    session.run("python", "-m", "benchmarks", *session.posargs)
