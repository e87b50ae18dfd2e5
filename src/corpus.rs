//! The built-in training corpus (Pride and Prejudice, public domain; see assets/CORPUS.md).

use meshgrad_nn::data::{DataError, TokenDataset};
use meshgrad_nn::tokenizer::Tokenizer;

/// The corpus text, embedded in the binary.
pub const BUILTIN_CORPUS: &[u8] = include_bytes!("../assets/corpus.txt");

/// The name of the built-in corpus in messages.
pub const BUILTIN_NAME: &str = "<built-in corpus: Pride and Prejudice>";

/// The corpus as byte-level tokens (vocab 256).
pub fn builtin_dataset() -> TokenDataset {
    TokenDataset::from_bytes(BUILTIN_NAME, BUILTIN_CORPUS)
}

/// The corpus as byte-level tokens, or as one document through `tokenizer`.
pub fn builtin_dataset_with(tokenizer: Option<&Tokenizer>) -> Result<TokenDataset, DataError> {
    match tokenizer {
        None => Ok(builtin_dataset()),
        Some(tok) => {
            let text = String::from_utf8_lossy(BUILTIN_CORPUS);
            TokenDataset::from_text(BUILTIN_NAME, &text, tok)
        }
    }
}
