//! Building blocks: linear, embedding, layer norm, dropout, attention, MLP, transformer block.

mod attention;
mod block;
mod dropout;
mod embedding;
mod layer_norm;
mod linear;
mod mlp;

pub use attention::CausalSelfAttention;
pub use block::{Block, BlockConfig};
pub use dropout::{Dropout, ForwardCtx};
pub use embedding::Embedding;
pub use layer_norm::LayerNorm;
pub use linear::Linear;
pub use mlp::Mlp;
