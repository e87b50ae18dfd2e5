//! The built-in training corpus (Pride and Prejudice, public domain; see assets/CORPUS.md).

use meshgrad_nn::data::TokenDataset;

/// The corpus text, embedded in the binary.
pub const BUILTIN_CORPUS: &[u8] = include_bytes!("../assets/corpus.txt");

/// The corpus as byte-level tokens (vocab 256).
pub fn builtin_dataset() -> TokenDataset {
    TokenDataset::from_bytes("<built-in corpus: Pride and Prejudice>", BUILTIN_CORPUS)
}
