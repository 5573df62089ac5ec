# busbw against message size for Lockstep's MPIBackend and the raw MPI call (bench_collectives
# --dat output). Usage: gnuplot -e "datafile='x.dat'; outfile='x.png'" busbw.gp
set terminal pngcairo size 900,520 font ",10"
set output outfile
set logscale x 2
set format x "%.0b%B"
set xlabel "message size (bytes, f32)"
set ylabel "busbw (GB/s, nccl-tests definition)"
set title "Allreduce and broadcast busbw: Lockstep MPIBackend vs raw MPI (same run)"
set key top left
set grid
plot datafile index 0 using 2:3 with linespoints lw 2 pt 7 title "allreduce, Lockstep", \
     datafile index 0 using 2:4 with linespoints lw 1 pt 6 dt 2 title "allreduce, raw MPI", \
     datafile index 1 using 2:3 with linespoints lw 2 pt 5 title "broadcast, Lockstep", \
     datafile index 1 using 2:4 with linespoints lw 1 pt 4 dt 2 title "broadcast, raw MPI"
