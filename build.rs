fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // SAFETY: build scripts are single-threaded; prost-build reads PROTOC from the environment.
    unsafe { std::env::set_var("PROTOC", protoc) };
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    // The descriptors of every service served, for gRPC reflection.
    tonic_prost_build::configure()
        .file_descriptor_set_path(out.join("descriptors.bin"))
        .bytes(".larder.v1.Batch.data")
        .bytes(".larder.v1.FieldBatch.data")
        .compile_protos(
            &[
                "proto/larder/v1/larder.proto",
                "proto/grpc/health/v1/health.proto",
            ],
            &["proto"],
        )?;
    println!("cargo:rerun-if-changed=proto");
    // A JPEG region decoded through libjpeg's API (libjpeg62-turbo-dev, scripts/setup): a small
    // C file that turns libjpeg's longjmp errors into return codes.
    cc::Build::new()
        .file("src/pipeline/jpeg_region.c")
        .warnings(true)
        .compile("larder_jpeg_region");
    println!("cargo:rustc-link-lib=jpeg");
    println!("cargo:rerun-if-changed=src/pipeline/jpeg_region.c");
    Ok(())
}
