//! Test infrastructure for imp: never shipped, only a dev-dependency.
//!
//! It holds the guard that decides whether a test whose environment is missing (root, a tool,
//! a binary) skips or fails: it skips on a developer machine and fails when `CI=true`, so a
//! skip can never pass as green in CI.

pub mod guard;
