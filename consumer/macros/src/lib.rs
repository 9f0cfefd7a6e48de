//! Procedural macros of Postal. Use them through `postal-consumer`, which re-exports them and
//! documents them.
//!
//! This crate only parses and checks the handler's signature; the generated code calls into
//! `postal_consumer::__private`, where the behaviour lives.

use proc_macro::TokenStream;
use proc_macro2::Span;
use quote::{format_ident, quote, quote_spanned};
use syn::parse::{Parse, ParseStream};
use syn::punctuated::Punctuated;
use syn::spanned::Spanned;
use syn::{
    Error, FnArg, GenericArgument, ItemFn, LitStr, MetaNameValue, PathArguments, ReturnType, Token,
    Type,
};

/// Turns an `async fn(tx, event) -> Result<(), HandlerError>` into an idempotent handler.
/// See `postal_consumer::idempotent` for the documentation.
#[proc_macro_attribute]
pub fn idempotent(attr: TokenStream, item: TokenStream) -> TokenStream {
    let args = syn::parse_macro_input!(attr as Args);
    let func = syn::parse_macro_input!(item as ItemFn);
    match expand(args, func) {
        Ok(ts) => ts.into(),
        Err(e) => e.to_compile_error().into(),
    }
}

struct Args {
    consumer: LitStr,
    /// `crate = "path"`: where `postal_consumer` is (for a crate that re-exports it).
    krate: Option<syn::Path>,
}

impl Parse for Args {
    fn parse(input: ParseStream<'_>) -> syn::Result<Self> {
        let pairs = Punctuated::<MetaNameValue, Token![,]>::parse_terminated(input)?;
        let mut consumer = None;
        let mut krate = None;
        for pair in pairs {
            let is_crate = pair.path.is_ident("crate");
            if !pair.path.is_ident("consumer") && !is_crate {
                return Err(Error::new(
                    pair.path.span(),
                    "unknown argument: `#[idempotent]` takes `consumer = \"name\"` (and optionally `crate = \"path::to::postal_consumer\"`)",
                ));
            }
            let lit =
                match &pair.value {
                    syn::Expr::Lit(syn::ExprLit {
                        lit: syn::Lit::Str(s),
                        ..
                    }) => s.clone(),
                    other if is_crate => return Err(Error::new(
                        other.span(),
                        "the crate path must be a string literal: `crate = \"my_crate::postal\"`",
                    )),
                    other => {
                        return Err(Error::new(
                            other.span(),
                            "the consumer name must be a string literal",
                        ))
                    }
                };
            if is_crate {
                let path: syn::Path = lit.parse()?;
                if krate.replace(path).is_some() {
                    return Err(Error::new(pair.path.span(), "`crate` is given twice"));
                }
                continue;
            }
            if lit.value().trim().is_empty() {
                return Err(Error::new(
                    lit.span(),
                    "the consumer name must not be empty",
                ));
            }
            if consumer.replace(lit).is_some() {
                return Err(Error::new(pair.path.span(), "`consumer` is given twice"));
            }
        }
        let consumer = consumer.ok_or_else(|| {
            Error::new(
                Span::call_site(),
                "missing consumer name: write `#[idempotent(consumer = \"name\")]`",
            )
        })?;
        Ok(Args { consumer, krate })
    }
}

/// The state type `T` of a parameter typed `State<T>` (any path ending in `State`).
fn state_type(ty: &Type) -> Option<&Type> {
    single_argument(ty, "State")
}

/// The payload type `T` of a parameter typed `Event<T>` (any path ending in `Event`).
fn event_payload(ty: &Type) -> Option<&Type> {
    single_argument(ty, "Event")
}

/// What the last parameter takes: one event, or the events of a batch.
enum Input<'a> {
    /// `Event<T>`.
    Event(&'a Type),
    /// `Batch<T>`.
    Batch(&'a Type),
    /// `&[Event<T>]`.
    Slice(&'a Type),
}

impl<'a> Input<'a> {
    fn payload(&self) -> &'a Type {
        match self {
            Input::Event(t) | Input::Batch(t) | Input::Slice(t) => t,
        }
    }
}

/// The last parameter's kind, or the error pointing at it.
fn input(ty: &Type) -> syn::Result<Input<'_>> {
    if let Some(t) = event_payload(ty) {
        return Ok(Input::Event(t));
    }
    if let Some(t) = single_argument(ty, "Batch") {
        return Ok(Input::Batch(t));
    }
    if let Type::Reference(r) = ty {
        if let Type::Slice(slice) = &*r.elem {
            if let Some(t) = event_payload(&slice.elem) {
                if let Some(m) = r.mutability {
                    return Err(Error::new(
                        m.span(),
                        "a batch handler takes its events as `&[Event<YourPayload>]` (not `&mut`) or `Batch<YourPayload>`",
                    ));
                }
                return Ok(Input::Slice(t));
            }
        }
    }
    Err(Error::new(
        ty.span(),
        "the last parameter must be the event: `Event<YourPayload>`, or for a batch handler the events: `Batch<YourPayload>` or `&[Event<YourPayload>]`",
    ))
}

/// `T` of a type written `<path>::Name<T>`.
fn single_argument<'a>(ty: &'a Type, name: &str) -> Option<&'a Type> {
    let Type::Path(p) = ty else { return None };
    let last = p.path.segments.last()?;
    if last.ident != name {
        return None;
    }
    let PathArguments::AngleBracketed(args) = &last.arguments else {
        return None;
    };
    if args.args.len() != 1 {
        return None;
    }
    match args.args.first()? {
        GenericArgument::Type(t) => Some(t),
        _ => None,
    }
}

/// Checks that the return type is written `Result<(), HandlerError>` (paths allowed).
fn check_return(ty: &Type) -> syn::Result<()> {
    let wrong = |span: Span| {
        Err(Error::new(
            span,
            "`#[idempotent]` handlers must return `Result<(), HandlerError>`",
        ))
    };
    let Type::Path(p) = ty else {
        return wrong(ty.span());
    };
    let Some(last) = p.path.segments.last() else {
        return wrong(ty.span());
    };
    let PathArguments::AngleBracketed(args) = &last.arguments else {
        return wrong(ty.span());
    };
    if last.ident != "Result" || args.args.len() != 2 {
        return wrong(ty.span());
    }
    match &args.args[0] {
        GenericArgument::Type(Type::Tuple(t)) if t.elems.is_empty() => {}
        other => return wrong(other.span()),
    }
    match &args.args[1] {
        GenericArgument::Type(Type::Path(e))
            if e.path
                .segments
                .last()
                .is_some_and(|s| s.ident == "HandlerError") => {}
        other => return wrong(other.span()),
    }
    Ok(())
}

fn expand(args: Args, func: ItemFn) -> syn::Result<proc_macro2::TokenStream> {
    let sig = &func.sig;
    if sig.asyncness.is_none() {
        return Err(Error::new(
            sig.fn_token.span(),
            "`#[idempotent]` handlers must be `async fn`",
        ));
    }
    if !sig.generics.params.is_empty() || sig.generics.where_clause.is_some() {
        return Err(Error::new(
            sig.generics.span(),
            "`#[idempotent]` handlers cannot be generic",
        ));
    }
    if let Some(v) = &sig.variadic {
        return Err(Error::new(
            v.span(),
            "`#[idempotent]` handlers cannot be variadic",
        ));
    }
    let inputs: Vec<&FnArg> = sig.inputs.iter().collect();
    if let Some(FnArg::Receiver(r)) = inputs.first() {
        return Err(Error::new(
            r.span(),
            "`#[idempotent]` handlers are free functions, not methods",
        ));
    }
    if !(2..=3).contains(&inputs.len()) {
        return Err(Error::new(
            sig.paren_token.span.join(),
            "expected the parameters `[State<YourState>,] tx: &mut Transaction<'_, Postgres>, event: Event<YourPayload>` (or, for a batch handler, `events: Batch<YourPayload>` or `&[Event<YourPayload>]` last)",
        ));
    }
    let typed = |a: &FnArg| match a {
        FnArg::Typed(t) => Ok(t.clone()),
        FnArg::Receiver(r) => Err(Error::new(r.span(), "unexpected `self`")),
    };
    let state_arg = if inputs.len() == 3 {
        Some(typed(inputs[0])?)
    } else {
        None
    };
    let tx_arg = typed(inputs[inputs.len() - 2])?;
    let ev_arg = typed(inputs[inputs.len() - 1])?;
    let state = match &state_arg {
        Some(arg) => Some(state_type(&arg.ty).ok_or_else(|| {
            Error::new(
                arg.ty.span(),
                "with three parameters the first must be the state: `State<YourState>`",
            )
        })?),
        None => None,
    };
    match &*tx_arg.ty {
        Type::Reference(r) if r.mutability.is_some() => {}
        other => {
            return Err(Error::new(
                other.span(),
                "the transaction parameter must be `&mut Transaction<'_, Postgres>` (or `&mut PgConnection`)",
            ))
        }
    }
    let input = input(&ev_arg.ty)?;
    let payload = input.payload();
    match &sig.output {
        ReturnType::Default => {
            return Err(Error::new(
                sig.ident.span(),
                "`#[idempotent]` handlers must return `Result<(), HandlerError>`",
            ))
        }
        ReturnType::Type(_, t) => check_return(t)?,
    };

    let name = &sig.ident;
    let vis = &func.vis;
    let consumer = &args.consumer;
    let (docs, other_attrs): (Vec<_>, Vec<_>) =
        func.attrs.iter().partition(|a| a.path().is_ident("doc"));
    let body_ident = format_ident!("__postal_body");
    let mut body_sig = sig.clone();
    body_sig.ident = body_ident.clone();
    let block = &func.block;
    let tx_ty_span = tx_arg.ty.span();
    let ev_ty_span = ev_arg.ty.span();
    let tx_pass = quote_spanned!(tx_ty_span=> tx);
    let ev_pass = quote_spanned!(ev_ty_span=> event);
    let krate = match &args.krate {
        Some(path) => quote!(#path),
        None => default_crate_path(),
    };
    let p = quote!(#krate::__private);
    let header = quote! {
        #(#docs)*
        #[allow(non_camel_case_types)]
        #[derive(Clone, Copy, Debug, Default)]
        #vis struct #name;
    };
    if !matches!(input, Input::Event(_)) {
        let pass = match input {
            Input::Slice(_) => quote_spanned!(ev_ty_span=> events.events()),
            _ => quote_spanned!(ev_ty_span=> events),
        };
        return Ok(expand_batch(BatchParts {
            header,
            name,
            vis,
            consumer,
            krate: &krate,
            payload,
            state,
            other_attrs: &other_attrs,
            body_sig: &body_sig,
            body_ident: &body_ident,
            block,
            tx_pass: &tx_pass,
            pass,
        }));
    }
    let Some(state) = state else {
        return Ok(quote! {
            #header

            impl #name {
                /// The dedup scope of this handler (`processed_events.consumer_name`).
                #vis const CONSUMER: &'static str = #consumer;

                /// Runs the handler inside the caller's transaction, under a savepoint: records
                /// the dedup row with `ON CONFLICT DO NOTHING`; if it already existed, skips the
                /// body and returns `Outcome::Duplicate`, otherwise runs the body and returns
                /// `Outcome::Applied`. On error the savepoint is rolled back (dedup row and
                /// effects together) and the caller's transaction stays usable. The caller
                /// commits.
                #[allow(dead_code)]
                #vis async fn call<'c>(
                    tx: &mut #p::sqlx::Transaction<'c, #p::sqlx::Postgres>,
                    event: #krate::Event<#payload>,
                ) -> ::core::result::Result<#krate::Outcome, #krate::HandlerError> {
                    #p::standalone(&#name, tx, event).await
                }

                #(#other_attrs)*
                #[doc(hidden)]
                #body_sig #block
            }

            impl #krate::Handler for #name {
                type Payload = #payload;

                fn consumer(&self) -> &str {
                    Self::CONSUMER
                }

                fn name(&self) -> &str {
                    ::core::stringify!(#name)
                }

                fn handle<'a, 'c>(
                    &'a self,
                    tx: &'a mut #p::sqlx::Transaction<'c, #p::sqlx::Postgres>,
                    event: #krate::Event<#payload>,
                ) -> #p::BoxFuture<'a, ::core::result::Result<(), #krate::HandlerError>> {
                    ::std::boxed::Box::pin(Self::#body_ident(#tx_pass, #ev_pass))
                }
            }
        });
    };
    let state_span = state.span();
    let bound = quote_spanned!(state_span=> #state: #krate::FromRef<__PostalState>);
    Ok(quote! {
        #header

        impl #name {
            /// The dedup scope of this handler (`processed_events.consumer_name`).
            #vis const CONSUMER: &'static str = #consumer;

            /// Runs the handler with `state` inside the caller's transaction, under a
            /// savepoint: records the dedup row with `ON CONFLICT DO NOTHING`; if it already
            /// existed, skips the body and returns `Outcome::Duplicate`, otherwise runs the body
            /// and returns `Outcome::Applied`. On error the savepoint is rolled back (dedup row
            /// and effects together) and the caller's transaction stays usable. The caller
            /// commits.
            #[allow(dead_code)]
            #vis async fn call<'c>(
                state: #krate::State<#state>,
                tx: &mut #p::sqlx::Transaction<'c, #p::sqlx::Postgres>,
                event: #krate::Event<#payload>,
            ) -> ::core::result::Result<#krate::Outcome, #krate::HandlerError> {
                #p::standalone(&#p::WithState::<#name>::new(state.0), tx, event).await
            }

            #(#other_attrs)*
            #[doc(hidden)]
            #body_sig #block
        }

        impl #p::StatefulHandler for #name {
            type State = #state;
            type Payload = #payload;
            const CONSUMER: &'static str = #consumer;
            const NAME: &'static str = ::core::stringify!(#name);

            fn handle<'a, 'c>(
                state: &'a #state,
                tx: &'a mut #p::sqlx::Transaction<'c, #p::sqlx::Postgres>,
                event: #krate::Event<#payload>,
            ) -> #p::BoxFuture<'a, ::core::result::Result<(), #krate::HandlerError>> {
                ::std::boxed::Box::pin(Self::#body_ident(
                    #krate::State(::core::clone::Clone::clone(state)),
                    #tx_pass,
                    #ev_pass,
                ))
            }
        }

        impl<__PostalState> #krate::IntoHandler<__PostalState> for #name
        where
            #bound,
        {
            type Handler = #p::WithState<#name>;

            fn into_handler(self, state: &__PostalState) -> Self::Handler {
                #p::WithState::new(<#state as #krate::FromRef<__PostalState>>::from_ref(state))
            }
        }
    })
}

/// What the expansion of a batch handler needs.
struct BatchParts<'a> {
    header: proc_macro2::TokenStream,
    name: &'a syn::Ident,
    vis: &'a syn::Visibility,
    consumer: &'a LitStr,
    krate: &'a proc_macro2::TokenStream,
    payload: &'a Type,
    state: Option<&'a Type>,
    other_attrs: &'a [&'a syn::Attribute],
    body_sig: &'a syn::Signature,
    body_ident: &'a syn::Ident,
    block: &'a syn::Block,
    tx_pass: &'a proc_macro2::TokenStream,
    /// How the `Batch` named `events` is passed to the body.
    pass: proc_macro2::TokenStream,
}

/// A batch handler: `BatchHandler` (through `StatefulBatchHandler` and `IntoBatchHandler` when
/// it takes a state) and a standalone `call` taking the events as a `Vec`.
fn expand_batch(b: BatchParts<'_>) -> proc_macro2::TokenStream {
    let BatchParts {
        header,
        name,
        vis,
        consumer,
        krate,
        payload,
        state,
        other_attrs,
        body_sig,
        body_ident,
        block,
        tx_pass,
        pass,
    } = b;
    let p = quote!(#krate::__private);
    let Some(state) = state else {
        return quote! {
            #header

            impl #name {
                /// The dedup scope of this handler (`processed_events.consumer_name`).
                #vis const CONSUMER: &'static str = #consumer;

                /// Runs the batch handler inside the caller's transaction, under a savepoint:
                /// records the events' dedup rows with `ON CONFLICT DO NOTHING` and runs the
                /// body once with the events whose rows were new (the first of a repeated id),
                /// in the order given. Returns one `Outcome` per event given. On error the
                /// savepoint is rolled back (dedup rows and effects together) and the caller's
                /// transaction stays usable. The caller commits.
                #[allow(dead_code)]
                #vis async fn call<'c>(
                    tx: &mut #p::sqlx::Transaction<'c, #p::sqlx::Postgres>,
                    events: ::std::vec::Vec<#krate::Event<#payload>>,
                ) -> ::core::result::Result<::std::vec::Vec<#krate::Outcome>, #krate::HandlerError> {
                    #p::standalone_batch(&#name, tx, events).await
                }

                #(#other_attrs)*
                #[doc(hidden)]
                #body_sig #block
            }

            impl #krate::BatchHandler for #name {
                type Payload = #payload;

                fn consumer(&self) -> &str {
                    Self::CONSUMER
                }

                fn name(&self) -> &str {
                    ::core::stringify!(#name)
                }

                fn handle_batch<'a, 'c>(
                    &'a self,
                    tx: &'a mut #p::sqlx::Transaction<'c, #p::sqlx::Postgres>,
                    events: #krate::Batch<#payload>,
                ) -> #p::BoxFuture<'a, ::core::result::Result<(), #krate::HandlerError>> {
                    ::std::boxed::Box::pin(async move { Self::#body_ident(#tx_pass, #pass).await })
                }
            }
        };
    };
    let state_span = state.span();
    let bound = quote_spanned!(state_span=> #state: #krate::FromRef<__PostalState>);
    quote! {
        #header

        impl #name {
            /// The dedup scope of this handler (`processed_events.consumer_name`).
            #vis const CONSUMER: &'static str = #consumer;

            /// Runs the batch handler with `state` inside the caller's transaction, under a
            /// savepoint: records the events' dedup rows with `ON CONFLICT DO NOTHING` and runs
            /// the body once with the events whose rows were new (the first of a repeated id),
            /// in the order given. Returns one `Outcome` per event given. On error the
            /// savepoint is rolled back (dedup rows and effects together) and the caller's
            /// transaction stays usable. The caller commits.
            #[allow(dead_code)]
            #vis async fn call<'c>(
                state: #krate::State<#state>,
                tx: &mut #p::sqlx::Transaction<'c, #p::sqlx::Postgres>,
                events: ::std::vec::Vec<#krate::Event<#payload>>,
            ) -> ::core::result::Result<::std::vec::Vec<#krate::Outcome>, #krate::HandlerError> {
                #p::standalone_batch(&#p::WithBatchState::<#name>::new(state.0), tx, events).await
            }

            #(#other_attrs)*
            #[doc(hidden)]
            #body_sig #block
        }

        impl #p::StatefulBatchHandler for #name {
            type State = #state;
            type Payload = #payload;
            const CONSUMER: &'static str = #consumer;
            const NAME: &'static str = ::core::stringify!(#name);

            fn handle_batch<'a, 'c>(
                state: &'a #state,
                tx: &'a mut #p::sqlx::Transaction<'c, #p::sqlx::Postgres>,
                events: #krate::Batch<#payload>,
            ) -> #p::BoxFuture<'a, ::core::result::Result<(), #krate::HandlerError>> {
                ::std::boxed::Box::pin(async move {
                    Self::#body_ident(
                        #krate::State(::core::clone::Clone::clone(state)),
                        #tx_pass,
                        #pass,
                    )
                    .await
                })
            }
        }

        impl<__PostalState> #krate::IntoBatchHandler<__PostalState> for #name
        where
            #bound,
        {
            type Handler = #p::WithBatchState<#name>;

            fn into_batch_handler(self, state: &__PostalState) -> Self::Handler {
                #p::WithBatchState::new(<#state as #krate::FromRef<__PostalState>>::from_ref(state))
            }
        }
    }
}

/// Where `postal_consumer` is for the crate being compiled: `::postal_consumer` when it depends
/// on that crate (also under another name), `::postal::consumer` when it depends only on the
/// facade (`postal-outbox`, library `postal`). `crate = "…"` overrides it.
fn default_crate_path() -> proc_macro2::TokenStream {
    use proc_macro_crate::{crate_name, FoundCrate};
    let named = |name: &str| {
        let ident = format_ident!("{}", name.replace('-', "_"));
        quote!(::#ident)
    };
    match crate_name("postal-consumer") {
        Ok(FoundCrate::Name(name)) => named(&name),
        // Inside postal-consumer itself (its doc tests and examples are other crates).
        Ok(FoundCrate::Itself) => quote!(::postal_consumer),
        // The facade is the package `postal-outbox` whose library is `postal`: a dependency
        // under its own name is `::postal`, one renamed in Cargo.toml is that name.
        Err(_) => match crate_name("postal-outbox") {
            Ok(FoundCrate::Name(name)) if name == "postal_outbox" => quote!(::postal::consumer),
            Ok(FoundCrate::Name(name)) => {
                let facade = named(&name);
                quote!(#facade::consumer)
            }
            // The facade's own doc tests.
            Ok(FoundCrate::Itself) => quote!(::postal::consumer),
            Err(_) => quote!(::postal_consumer),
        },
    }
}
