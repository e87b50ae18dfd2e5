//! `#[derive(Module)]` for meshgrad models, and `#[derive(FusedArgs)]` for the argument structs
//! of `meshgrad-tensor`'s fused ops (see [`derive_fused_args`]).
//!
//! The derive implements `Module::visit_children` from the struct's fields, so every parameter
//! and submodule is named once, by its field name:
//!
//! * a field of type `Var` is a parameter named after the field;
//! * a field whose type implements `Module` is a submodule named after the field;
//! * `Option<T>` visits its value when present; `Vec<T>` visits its elements as `field.0`,
//!   `field.1`, ...; `Arc<T>` and `Box<T>` visit what they hold;
//! * any other field (sizes, configs, flags) is plain data and is not visited;
//! * `#[module(skip)]` leaves a field out, `#[module(rename = "name")]` visits it under another
//!   name (for checkpoint formats whose names are not valid Rust identifiers).
//!
//! Generated code refers to the `meshgrad` crate (`::meshgrad::nn`); code that depends on
//! `meshgrad-nn` directly writes `#[module(crate = meshgrad_nn)]` on the struct (inside
//! `meshgrad-nn` itself, `#[module(crate = crate)]`).

use proc_macro::TokenStream;
use proc_macro2::TokenStream as TokenStream2;
use quote::{format_ident, quote};
use syn::{parse_macro_input, Data, DeriveInput, Fields, LitStr, Path};

/// Derives `Module` (see the crate docs).
#[proc_macro_derive(Module, attributes(module))]
pub fn derive_module(input: TokenStream) -> TokenStream {
    let input = parse_macro_input!(input as DeriveInput);
    match expand(&input) {
        Ok(ts) => ts.into(),
        Err(e) => e.to_compile_error().into(),
    }
}

fn crate_path(input: &DeriveInput) -> syn::Result<TokenStream2> {
    let mut krate: Option<TokenStream2> = None;
    for attr in &input.attrs {
        if !attr.path().is_ident("module") {
            continue;
        }
        attr.parse_nested_meta(|meta| {
            if meta.path.is_ident("crate") {
                let p: Path = meta.value()?.parse()?;
                krate = Some(quote!(#p));
                Ok(())
            } else {
                Err(meta
                    .error("unknown #[module(...)] option on a struct: expected `crate = path`"))
            }
        })?;
    }
    Ok(krate.unwrap_or_else(|| quote!(::meshgrad::nn)))
}

struct FieldOpts {
    skip: bool,
    rename: Option<String>,
}

fn field_opts(attrs: &[syn::Attribute]) -> syn::Result<FieldOpts> {
    let mut o = FieldOpts {
        skip: false,
        rename: None,
    };
    for attr in attrs {
        if !attr.path().is_ident("module") {
            continue;
        }
        attr.parse_nested_meta(|meta| {
            if meta.path.is_ident("skip") {
                o.skip = true;
                Ok(())
            } else if meta.path.is_ident("rename") {
                let s: LitStr = meta.value()?.parse()?;
                o.rename = Some(s.value());
                Ok(())
            } else {
                Err(meta.error(
                    "unknown #[module(...)] option on a field: expected `skip` or `rename = \"name\"`",
                ))
            }
        })?;
    }
    Ok(o)
}

fn expand(input: &DeriveInput) -> syn::Result<TokenStream2> {
    let krate = crate_path(input)?;
    let ident = &input.ident;
    let fields = match &input.data {
        Data::Struct(s) => &s.fields,
        _ => {
            return Err(syn::Error::new_spanned(
                ident,
                "#[derive(Module)] supports structs only; implement Module by hand for enums",
            ))
        }
    };
    let mut visits = Vec::new();
    let members: Vec<(syn::Member, String, &syn::Field)> = match fields {
        Fields::Named(n) => n
            .named
            .iter()
            .map(|f| {
                let id = f.ident.clone().expect("named field");
                let name = id.to_string();
                let name = name.strip_prefix("r#").unwrap_or(&name).to_string();
                (syn::Member::Named(id), name, f)
            })
            .collect(),
        Fields::Unnamed(u) => u
            .unnamed
            .iter()
            .enumerate()
            .map(|(i, f)| (syn::Member::Unnamed(i.into()), i.to_string(), f))
            .collect(),
        Fields::Unit => Vec::new(),
    };
    for (member, name, field) in members {
        let opts = field_opts(&field.attrs)?;
        if opts.skip {
            continue;
        }
        let name = opts.rename.unwrap_or(name);
        visits.push(quote! {
            (&&#krate::module::__derive::Wrap(&self.#member)).__visit_field(#name, __f);
        });
    }
    let (impl_generics, ty_generics, where_clause) = input.generics.split_for_impl();
    let type_name = ident.to_string();
    let via_field = format_ident!("ViaField");
    let via_nothing = format_ident!("ViaNothing");
    Ok(quote! {
        impl #impl_generics #krate::Module for #ident #ty_generics #where_clause {
            fn visit_children(&self, __f: &mut dyn FnMut(&str, #krate::module::Child<'_>)) {
                #[allow(unused_imports)]
                use #krate::module::__derive::{#via_field as _, #via_nothing as _};
                #(#visits)*
            }
            fn module_type(&self) -> &'static str {
                #type_name
            }
        }
    })
}

/// Derives `FusedArgs` for a fused op's argument struct `Foo<T>` or `Foo<T, W>` (inside
/// `meshgrad-tensor`): implements `crate::ops::fused::FusedArgs` for `Foo<&Tensor>` (or
/// `Foo<&Tensor, &Tensor>`) with `Args<U, V> = Foo<U>` (or `Foo<U, V>`) and a `map` that
/// replaces every operand read by `read(operand)` and every operand written by
/// `write(operand)`, visiting the fields in declaration order:
///
/// * a field of type `T` (the struct's first type parameter) is an operand read;
/// * `Option<T>` is an optional operand read (mapped when present);
/// * a field of type `W` (the optional second type parameter) is an operand written in place;
/// * a field of type `Part<T>` (another generic struct over `T` alone, not `Option`) is a part
///   of the arguments with a `FusedArgs` of its own, mapped by its `map`: operands that several
///   ops share (an attention mask, a linear layer's operands) are declared once;
/// * any other field (shapes, scalars, flags) is copied (cloned).
#[proc_macro_derive(FusedArgs)]
pub fn derive_fused_args(input: TokenStream) -> TokenStream {
    let input = parse_macro_input!(input as DeriveInput);
    match expand_fused_args(&input) {
        Ok(ts) => ts.into(),
        Err(e) => e.to_compile_error().into(),
    }
}

/// How `map` carries one field of a `FusedArgs` struct over.
enum Carried {
    Operand,
    Optional,
    Written,
    Nested,
    Copied,
}

/// `T`, `Option<T>`, `W`, `Part<T>` or another type, for the struct's type parameters `t` and
/// `w`.
fn carried(ty: &syn::Type, t: &syn::Ident, w: Option<&syn::Ident>) -> Carried {
    let syn::Type::Path(p) = ty else {
        return Carried::Copied;
    };
    if p.qself.is_none() && p.path.is_ident(t) {
        return Carried::Operand;
    }
    if p.qself.is_none() && w.is_some_and(|w| p.path.is_ident(w)) {
        return Carried::Written;
    }
    let Some(last) = p.path.segments.last() else {
        return Carried::Copied;
    };
    let syn::PathArguments::AngleBracketed(a) = &last.arguments else {
        return Carried::Copied;
    };
    match a.args.first() {
        Some(syn::GenericArgument::Type(syn::Type::Path(inner)))
            if a.args.len() == 1 && inner.qself.is_none() && inner.path.is_ident(t) =>
        {
            if last.ident == "Option" {
                Carried::Optional
            } else {
                Carried::Nested
            }
        }
        _ => Carried::Copied,
    }
}

fn expand_fused_args(input: &DeriveInput) -> syn::Result<TokenStream2> {
    let name = &input.ident;
    let params: Vec<_> = input.generics.type_params().collect();
    if !(1..=2).contains(&params.len()) || input.generics.params.len() != params.len() {
        return Err(syn::Error::new_spanned(
            &input.generics,
            "#[derive(FusedArgs)] needs a struct with one or two type parameters (the operand \
             types: read, and written in place)",
        ));
    }
    let t = &params[0].ident;
    let w = params.get(1).map(|p| &p.ident);
    let Data::Struct(s) = &input.data else {
        return Err(syn::Error::new_spanned(
            name,
            "#[derive(FusedArgs)] is for structs",
        ));
    };
    let Fields::Named(fields) = &s.fields else {
        return Err(syn::Error::new_spanned(
            name,
            "#[derive(FusedArgs)] needs named fields",
        ));
    };
    let inits = fields.named.iter().map(|fd| {
        let f = fd.ident.as_ref().expect("named field");
        match carried(&fd.ty, t, w) {
            Carried::Operand => quote!(#f: read(self.#f)),
            Carried::Optional => quote!(#f: self.#f.map(&mut read)),
            Carried::Written => quote!(#f: write(self.#f)),
            Carried::Nested => {
                quote!(#f: crate::ops::fused::FusedArgs::map(&self.#f, &mut read, &mut write))
            }
            Carried::Copied => quote!(#f: ::core::clone::Clone::clone(&self.#f)),
        }
    });
    let (lifetimes, tensors, args) = match w {
        None => (quote!('t), quote!(&'t crate::Tensor), quote!(#name<U>)),
        Some(_) => (
            quote!('t, 'u),
            quote!(&'t crate::Tensor, &'u crate::Tensor),
            quote!(#name<U, V>),
        ),
    };
    Ok(quote! {
        impl<#lifetimes> crate::ops::fused::FusedArgs for #name<#tensors> {
            type Args<U, V> = #args;

            #[allow(unused_mut, unused_variables)]
            fn map<'s, U, V>(
                &'s self,
                mut read: impl FnMut(&'s crate::Tensor) -> U,
                mut write: impl FnMut(&'s crate::Tensor) -> V,
            ) -> #args {
                #name { #(#inits,)* }
            }
        }
    })
}
