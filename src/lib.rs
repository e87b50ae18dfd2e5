//! meshgrad: re-exports.
