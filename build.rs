fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // SAFETY: build scripts are single-threaded; prost-build reads PROTOC from the environment.
    unsafe { std::env::set_var("PROTOC", protoc) };
    tonic_prost_build::configure()
        .bytes(".larder.v1.Batch.data")
        .bytes(".larder.v1.FieldBatch.data")
        .compile_protos(&["proto/larder/v1/larder.proto"], &["proto"])?;
    println!("cargo:rerun-if-changed=proto/larder/v1/larder.proto");
    Ok(())
}
