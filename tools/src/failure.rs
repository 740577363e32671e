//! Why a command failed, and the exit code that says so: 2 for bad input (as clap uses for bad
//! arguments), 1 for anything that went wrong while running.

use std::fmt;

/// A failed command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// The command line asks for something impossible: a bad URL, a backend that does not
    /// exist, options that do not go together. Exit code 2.
    BadInput(String),
    /// Something failed while running: a peer, a socket, the server process. Exit code 1.
    Failed(String),
}

impl Failure {
    /// The process exit code.
    pub fn exit_code(&self) -> i32 {
        match self {
            Failure::BadInput(_) => 2,
            Failure::Failed(_) => 1,
        }
    }

    /// Adds what was being done to the message.
    pub fn context(self, what: &str) -> Failure {
        match self {
            Failure::BadInput(m) => Failure::BadInput(format!("{what}: {m}")),
            Failure::Failed(m) => Failure::Failed(format!("{what}: {m}")),
        }
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::BadInput(m) | Failure::Failed(m) => f.write_str(m),
        }
    }
}

impl From<actorpipe::Error> for Failure {
    /// A bad URL or a backend the other side cannot use is the caller's to fix; the rest is a
    /// failure while running.
    fn from(e: actorpipe::Error) -> Failure {
        match e.class() {
            "invalid_argument" | "unavailable" => Failure::BadInput(e.to_string()),
            _ => Failure::Failed(e.to_string()),
        }
    }
}

impl From<std::io::Error> for Failure {
    fn from(e: std::io::Error) -> Failure {
        Failure::Failed(e.to_string())
    }
}

impl From<actix::MailboxError> for Failure {
    fn from(e: actix::MailboxError) -> Failure {
        Failure::Failed(format!("an actor stopped before answering ({e})"))
    }
}

/// Shorthand for a bad-input failure.
pub fn bad(message: impl Into<String>) -> Failure {
    Failure::BadInput(message.into())
}
