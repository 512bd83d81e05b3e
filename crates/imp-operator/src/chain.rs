//! An error with its causes on one log line (`error = %DisplayChain(&e)`): `Display` of a
//! `thiserror` error says only what was being done, its sources say why. One definition for
//! every host-side crate, in imp-api.

pub(crate) use imp_api::chain::DisplayChain;
