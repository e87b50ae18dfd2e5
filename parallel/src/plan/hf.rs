//! A model's [`ModelShape`] from a Hugging Face `config.json` (`meshgrad plan --hf-config`):
//! GPT-2 (`"model_type": "gpt2"`), BERT (`"bert"`) and Llama (`"llama"`, and `"mistral"`,
//! which has Llama's shapes), read by the same readers `--init-from` uses. Mixtral's experts
//! are not modelled yet: its config is refused in one line.

use meshgrad_nn::state::{hf_bert, hf_gpt2, hf_llama};
use meshgrad_nn::ModelShape;

/// The shape `text` (a `config.json`, named `origin` in errors) describes, with `seq` positions.
pub fn shape_from_config(text: &str, origin: &str, seq: usize) -> Result<ModelShape, String> {
    let v: serde_json::Value =
        serde_json::from_str(text).map_err(|e| format!("{origin}: not a JSON config ({e})"))?;
    let kind = v.get("model_type").and_then(|t| t.as_str()).unwrap_or("");
    let err = |e: meshgrad_tensor::Error| format!("{origin}: {e}");
    let mut shape = match kind {
        "gpt2" => hf_gpt2::gpt_config_from_hf_json(text)
            .map_err(err)?
            .0
            .shape(),
        "bert" => hf_bert::bert_config_from_hf_json(text)
            .map_err(err)?
            .shape(),
        "llama" | "mistral" => hf_llama::llama_config_from_hf_json(text)
            .map_err(err)?
            .shape(),
        "mixtral" => {
            return Err(format!(
                "{origin}: Mixtral's mixture of experts is not modelled by the planner yet"
            ))
        }
        other => {
            return Err(format!(
                "{origin}: model_type '{other}' is not one the planner reads (gpt2, bert, llama)"
            ))
        }
    };
    shape.positions = seq;
    Ok(shape)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_llama_config_gives_its_shape() {
        // Llama-2-7B's config.json (the fields the reader needs).
        let text = r#"{"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
            "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
            "vocab_size": 32000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "tie_word_embeddings": false, "hidden_act": "silu"}"#;
        let s = shape_from_config(text, "config.json", 2048).unwrap();
        assert_eq!(
            (s.n_layer, s.n_embd, s.ffn, s.positions),
            (32, 4096, 11008, 2048)
        );
        // 6.74 B parameters, as published for Llama 2 7B.
        let p = crate::plan::memory::num_parameters(&s).unwrap();
        assert_eq!(p, 6_738_415_616);
        let e = shape_from_config(r#"{"model_type": "mixtral"}"#, "m.json", 8).unwrap_err();
        assert!(e.contains("not modelled"), "{e}");
    }
}
