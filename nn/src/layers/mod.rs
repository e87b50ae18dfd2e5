//! Building blocks: linear, embedding, layer norm, RMS norm, dropout, attention, MLP, transformer block,
//! activations and [`Sequential`].

mod activation;
mod attention;
mod block;
mod dropout;
mod embedding;
mod layer_norm;
mod linear;
mod lm_head;
mod mlp;
mod rms_norm;
mod sequence_entry;
mod sequential;

pub use activation::Activation;
pub use attention::CausalSelfAttention;
pub use block::{Block, BlockConfig};
pub use dropout::Dropout;
pub use embedding::Embedding;
pub use layer_norm::LayerNorm;
pub use linear::{Linear, LinearConfig};
pub use lm_head::LmHead;
pub use mlp::Mlp;
pub use rms_norm::RmsNorm;
pub use sequence_entry::SequenceEntry;
pub use sequential::Sequential;
