//! The crate's internals, for its own tools and tests: the `actorpipe` command's raw
//! baselines, the suites that drive a backend's pieces directly. Not part of the API: nothing
//! here is stable, documented for users, or covered by semver. Inside the crate these modules
//! are named from the root (`crate::backend`), as `src/lib.rs` brings them there.

#[path = "../auth.rs"]
pub mod auth;
#[path = "../backend/mod.rs"]
pub mod backend;
#[path = "../copy/mod.rs"]
pub mod copy;
#[path = "../error.rs"]
pub mod error;
#[path = "../fds.rs"]
pub mod fds;
/// The fuzz targets' checks (`fuzz/`), replayed over the kept seeds by the test suite.
pub mod fuzz;
#[path = "../handshake.rs"]
pub mod handshake;
#[path = "../keymap.rs"]
pub mod keymap;
#[path = "../message.rs"]
pub mod message;
#[path = "../negotiate.rs"]
pub mod negotiate;
#[path = "../topology.rs"]
pub mod topology;
#[path = "../wire/mod.rs"]
pub mod wire;
/// The actors that own device resources (the CUDA IPC handle cache, the efa endpoint, the
/// ibv queue pairs).
pub use crate::actors::hardware;
/// What every transport shares, with the loops every stream transport runs.
pub mod transport {
    pub use crate::transport::*;
    /// The read and write loops of every stream transport.
    pub mod stream {
        pub use crate::transport::stream::*;
    }
    /// Keepalive: heartbeats and silence.
    pub mod liveness {
        pub use crate::transport::liveness::*;
    }
    /// Whose turn it is on a context's thread: the runtime's queue or the actors'.
    pub mod turns {
        pub use crate::transport::turns::*;
    }
}
